// A sweep: progress over its jobs, the leaderboard as a sortable table and a chart (score per
// configuration, one bar per language expert with error bars, the experts' own scores as
// dashed lines), a per-pair view, and the best configuration marked with a link to its model.

import { api, TERMINAL } from "../api.js";
import { barChart } from "../charts.js";
import { baseName, facts, h, link, number, progress, section, shortId, status, table, when } from "../dom.js";

const COLUMNS = [
  ["rank", "rank", (r) => r.rank],
  ["config", "configuration", (r) => r.config],
  ["mean", "mean", (r) => r.mean],
  ["min", "min", (r) => r.min],
  ["max", "max", (r) => r.max],
  ["stderr", "stderr", (r) => r.stderr],
  ["pairs_scored", "pairs", (r) => r.pairs_scored],
  ["p", "p vs best", (r) => (r.vs_best ? r.vs_best.p_value : null)],
];

export async function render({ main, id, params, signal }) {
  const sweep = await api(`/v1/sweeps/${id}`, { signal });
  const board = await api(`/v1/sweeps/${id}/leaderboard`, { signal });
  main.append(h("h1", {}, `Sweep ${shortId(id)}`), overview(sweep));
  if (!board.rows.length) {
    main.append(h("p", { class: "muted" }, "No configuration has a score yet."));
  } else {
    const best = board.rows[0];
    main.append(bestSection(sweep, best));
    main.append(section("Leaderboard", leaderboardTable(board, params)));
    main.append(section("Chart", chart(board)));
    main.append(pairSection(board, params));
  }
  main.append(section("Trials", table([
    ["configuration", (t) => t.config],
    ["pair", (t) => (t.pair === null ? "expert" : t.pair)],
    ["merge", (t) => (t.merge_job_id ? link(`/merges/${t.merge_job_id}`, shortId(t.merge_job_id)) : "")],
    ["evaluation", (t) => (t.evaluation_job_id ? link(`/evaluations/${t.evaluation_job_id}`, shortId(t.evaluation_job_id)) : "")],
    ["status", (t) => status(t.evaluation_status || t.merge_status || "")],
    ["score", (t) => number(t.score)],
  ], sweep.trials)));
  if (!TERMINAL.has(sweep.status)) {
    const timer = setTimeout(() => window.dispatchEvent(new HashChangeEvent("hashchange")), 3000);
    signal.addEventListener("abort", () => clearTimeout(timer));
  }
}

function overview(sweep) {
  const p = sweep.progress;
  return section("Status", facts([
    ["id", h("span", { class: "mono" }, sweep.id)],
    ["status", status(sweep.status)],
    ["progress", h("span", {}, progress(p.fraction, "sweep progress", sweep.status), ` ${p.ended} of ${p.jobs} jobs`)],
    ["by status", Object.entries(p.by_status).map(([k, v]) => `${k}: ${v}`).join(", ")],
    ["objective", `${sweep.request.objective.task} ${sweep.request.objective.metric}`],
    ["created", when(sweep.created_at)],
    ["finished", when(sweep.finished_at)],
  ]));
}

function bestSection(sweep, best) {
  const models = sweep.trials.filter((t) => t.config === best.config && t.artifact_id);
  return section("Best configuration", h("p", { id: "best" }, h("strong", {}, best.config),
    ` mean ${number(best.mean)}`),
  models.length ? h("ul", {}, models.map((t) => h("li", {}, `pair ${t.pair}: `,
    link(`/merges/${t.merge_job_id}`, "merge ", shortId(t.merge_job_id)), " · ",
    link(`/artifacts/${t.artifact_id}/lineage`, "model ", shortId(t.artifact_id)))))
    : h("p", { class: "muted" }, "No model of it is written (yet)."));
}

function leaderboardTable(board, params) {
  const by = COLUMNS.find(([key]) => key === params.get("sort")) || COLUMNS[0];
  const descending = params.get("order") === "desc";
  const rows = [...board.rows].sort((a, b) => {
    const x = by[2](a);
    const y = by[2](b);
    const order = x === y ? 0 : x === null ? 1 : y === null ? -1 : x < y ? -1 : 1;
    return descending ? -order : order;
  });
  const heading = ([key, title]) => {
    const sorted = key === by[0];
    const order = sorted && !descending ? "desc" : "asc";
    const button = h("button", { type: "button", "data-sort": key }, title, sorted ? (descending ? " ▼" : " ▲") : "");
    button.addEventListener("click", () => {
      const next = new URLSearchParams(params);
      next.set("sort", key);
      next.set("order", order);
      location.hash = `${location.hash.slice(1).split("?")[0]}?${next}`;
    });
    return h("th", { scope: "col", "aria-sort": sorted ? (descending ? "descending" : "ascending") : null }, button);
  };
  const cell = ([key, , value], row) => {
    const v = value(row);
    return h("td", { class: typeof v === "number" && key !== "rank" ? "num" : null },
      typeof v === "number" && key !== "rank" && key !== "pairs_scored" ? number(v, key === "p" ? 3 : 4) : v ?? "–");
  };
  return h("table", { class: "leaderboard" },
    h("thead", {}, h("tr", {}, COLUMNS.map(heading))),
    h("tbody", {}, rows.map((row) => h("tr", { class: row.rank === 1 ? "best" : null, "data-config": row.config },
      COLUMNS.map((column) => cell(column, row))))));
}

function chart(board, only = null) {
  const pairs = board.per_pair.filter((pair) => only === null || pair.pair === only);
  const languages = [...new Set(pairs.map((pair) => pair.language_expert))];
  const groups = board.rows.map((row) => row.config);
  const series = languages.map((language) => {
    const indices = pairs.filter((pair) => pair.language_expert === language).map((pair) => String(pair.pair));
    return {
      name: baseName(language),
      values: board.rows.map((row) => mean(indices.map((i) => row.values[i]).filter((v) => v !== undefined))),
      errors: board.rows.map((row) => (only === null ? row.stderr || 0 : 0)),
    };
  });
  const experts = only === null ? Object.entries(board.experts)
    : [[pairs[0].task_expert, pairs[0].task_expert_score], [pairs[0].language_expert, pairs[0].language_expert_score]];
  const references = experts.filter(([, value]) => value !== null && value !== undefined)
    .map(([source, value]) => ({ name: baseName(source), value }));
  return barChart({ groups, series, references, best: 0,
    yLabel: `${board.objective.task} ${board.objective.metric}` });
}

function pairSection(board, params) {
  const chosen = Number(params.get("pair") || 0);
  const pair = board.per_pair.find((p) => p.pair === chosen) || board.per_pair[0];
  const picker = h("select", { name: "pair" }, board.per_pair.map((p) =>
    h("option", { value: p.pair, selected: p.pair === pair.pair },
      `${p.pair}: ${baseName(p.task_expert)} × ${baseName(p.language_expert)}`)));
  picker.addEventListener("change", () => {
    const next = new URLSearchParams(params);
    next.set("pair", picker.value);
    location.hash = `${location.hash.slice(1).split("?")[0]}?${next}`;
  });
  const rows = Object.entries(pair.configs).map(([config, value]) => ({ config, ...value }));
  return section("Per pair", h("div", { class: "toolbar" }, h("label", {}, "pair", picker)),
    facts([["task expert", `${pair.task_expert} (${number(pair.task_expert_score)})`],
      ["language expert", `${pair.language_expert} (${number(pair.language_expert_score)})`]]),
    table([["configuration", (r) => r.config], ["score", (r) => number(r.value)],
      ["minus the better expert", (r) => number(r.minus_best_expert)]], rows, { class: "pair" }),
    chart(board, pair.pair));
}

function mean(values) {
  return values.length ? values.reduce((a, b) => a + b, 0) / values.length : null;
}
