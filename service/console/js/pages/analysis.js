// An analysis: each expert's heatmap over layers and parameter kinds (hover or focus a cell:
// layer, module, value), and the suggested (bottom, top) — a heuristic, labelled so.

import { api, redrawOnChange, TERMINAL } from "../api.js";
import { heatmap } from "../charts.js";
import { facts, h, number, progress, section, shortId, status, table, when } from "../dom.js";
import { timeline } from "../timeline.js";

export async function render({ main, id, params, signal }) {
  const job = await api(`/v1/analyses/${id}`, { signal });
  if (!TERMINAL.has(job.status)) redrawOnChange(`/v1/analyses/${id}`, job, signal);
  main.append(h("h1", {}, `Analysis ${shortId(id)}`), section("Status", facts([
    ["id", h("span", { class: "mono" }, job.id)],
    ["status", status(job.status)],
    ["progress", progress(job.progress.fraction, "analysis progress", job.status)],
    ["base", job.request.base],
    ["experts", job.request.experts.map((e) => `${e.label} (${e.path})`).join(", ")],
    ["suggested", job.result?.suggestion ? `b = ${job.result.suggestion.bottom}, u = ${job.result.suggestion.top} (heuristic)` : null],
    ["created", when(job.created_at)],
    ["error", job.error ? h("span", { class: "error" }, `${job.error.code}: ${job.error.message}`) : null],
  ])));
  main.append(await timeline(`/v1/analyses/${id}`, job, signal, { follow: false })); // drawn anew on change
  if (job.status !== "succeeded") return;
  const data = await api(`/v1/analyses/${id}/analysis.json`, { signal });
  const measure = params.get("measure") === "mean_mav" ? "mean_mav" : "fraction";
  const picker = h("select", { name: "measure" },
    [["fraction", "fraction of rows above the threshold"], ["mean_mav", "mean row MAV"]]
      .map(([value, label]) => h("option", { value, selected: value === measure }, label)));
  picker.addEventListener("change", () => { location.hash = `/analyses/${id}?measure=${picker.value}`; });
  main.append(section("Heatmaps", h("div", { class: "toolbar" }, h("label", {}, "value", picker)),
    h("p", { class: "muted" }, `threshold ${number(data.threshold, 6)} (${data.threshold_rule})`),
    h("div", { class: "grid" }, Object.entries(data.experts).map(([label, expert]) =>
      h("div", { "data-expert": label }, h("h3", {}, label),
        heatmap({
          rows: expert[measure].map((_, layer) => `layer ${layer}`),
          columns: data.kinds,
          values: expert[measure],
          describe: (row, column, value) => `${label} · ${row} · ${column}: ${number(value, 6)}`,
        }))))));
  const suggestion = job.result.suggestion;
  if (suggestion) {
    main.append(section("Suggested layer swap",
      h("p", { id: "suggestion" }, `bottom b = ${suggestion.bottom}, top u = ${suggestion.top}`,
        suggestion.clamped ? " (clamped)" : ""),
      h("p", { class: "muted" }, suggestion.note),
      table([["layer", (r) => r.layer], [`task (${suggestion.task})`, (r) => number(r.task, 3)],
        [`language (${suggestion.language})`, (r) => number(r.language, 3)]],
      suggestion.layer_scores.task.map((task, layer) =>
        ({ layer, task, language: suggestion.layer_scores.language[layer] })))));
  }
}
