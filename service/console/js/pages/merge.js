// A merge: recipe, plan over depth, progress (live: a long poll that the server answers when
// the job changes), outputs with their sha256, Hub commits, MLflow version, webhook
// deliveries, and its evaluation beside its inputs'.

import { api, TERMINAL, watchJob } from "../api.js";
import { planStrip } from "../charts.js";
import {
  baseName, bytes, facts, h, link, number, pretty, progress, section, shortId, status, table, when,
} from "../dom.js";
import { outputSections } from "../outputs.js";
import { timeline } from "../timeline.js";

export async function render({ main, id, signal }) {
  let job = await api(`/v1/merges/${id}`, { signal });
  const title = h("h1", {}, `Merge ${job.output ? job.output.name : job.request.output?.name || shortId(id)}`);
  const head = h("div");
  const body = h("div");
  main.append(title, head, body);
  const draw = async () => {
    head.replaceChildren(summary(job));
    body.replaceChildren(...(await details(job, signal)));
  };
  await draw();
  head.after(await timeline(`/v1/merges/${id}`, job, signal));
  if (!TERMINAL.has(job.status)) {
    watchJob(`/v1/merges/${id}`, (fresh) => {
      job = fresh;
      head.replaceChildren(summary(job));
      if (TERMINAL.has(job.status)) draw().catch(() => {});
    }, signal);
  }
}

function summary(job) {
  const cancel = !TERMINAL.has(job.status) && job.status !== "canceling"
    ? h("button", { type: "button", class: "danger", id: "cancel" }, "Cancel")
    : "";
  if (cancel) {
    cancel.addEventListener("click", async () => {
      cancel.disabled = true;
      await api(`/v1/merges/${job.id}/cancel`, { method: "POST" });
    });
  }
  const p = job.progress;
  return section(
    "Status",
    facts([
      ["id", h("span", { class: "mono" }, job.id)],
      ["status", status(job.status)],
      ["stage", job.stage],
      ["progress", h("span", {}, progress(p.fraction, "merge progress", job.status),
        ` ${bytes(p.bytes_done)} / ${bytes(p.bytes_total)}, ${p.tensors_done}/${p.tensors_total} tensors`
        + (p.eta_s ? `, ETA ${Math.round(p.eta_s)} s` : ""))],
      ["attempts", job.attempts],
      ["created", when(job.created_at)],
      ["finished", when(job.finished_at)],
      ["error", job.error ? h("span", { class: "error" }, `${job.error.code}: ${job.error.message}`) : null],
    ]),
    cancel,
    rerun(job),
  );
}

/** Once it has ended: the create form, filled in with this merge's request. */
function rerun(job) {
  if (!TERMINAL.has(job.status)) return "";
  return h("a", { href: `#/new/merge?from=${job.id}`, class: "button", id: "rerun" }, "Run again / edit as new");
}

async function details(job, signal) {
  const parts = [];
  if (job.plan && job.plan.length) {
    parts.push(section("Plan", planStrip(job.plan), table(
      [["layer", (e) => e.layer], ["from", (e) => e.origin], ["made from", (e) => e.made_from]],
      job.plan, { class: "plan" })));
  }
  parts.push(section("Recipe", pretty(job.request)));
  if (job.output) parts.push(outputs(job), ...(await outputSections(job.output.artifact_id, signal)));
  const evaluation = job.result && job.result.evaluation;
  if (evaluation) parts.push(await scores(evaluation, signal));
  parts.push(await deliveries(job, signal));
  if (job.result) {
    parts.push(section("Result", pretty(Object.fromEntries(Object.entries(job.result)
      .filter(([key]) => key !== "evaluation")))));
  }
  return parts;
}

function outputs(job) {
  const out = job.output;
  const mlflow = job.result && job.result.mlflow;
  return section(
    "Output",
    facts([
      ["name", out.name],
      ["location", h("span", { class: "mono" }, out.location)],
      ["artifact", link(`/artifacts/${out.artifact_id}/lineage`, "lineage of ", shortId(out.artifact_id))],
      ["Hub", out.published.length ? h("span", {}, out.published.map((commit) =>
        hubLink(commit))) : null],
      ["MLflow", mlflow ? `${mlflow.registered_model} version ${mlflow.version}` +
        (mlflow.alias ? ` (alias ${mlflow.alias})` : "") : null],
    ]),
  );
}

function hubLink(commit) {
  const url = commit.url;
  const label = `${commit.repo}@${commit.branch} ${shortId(commit.commit)}`;
  // Only http(s) links: a stored value must not become a javascript: URL.
  return url && /^https?:\/\//.test(url) ? h("a", { href: url, rel: "noreferrer" }, label) : label;
}

async function scores(evaluation, signal) {
  const parts = [facts([
    ["evaluation", link(`/evaluations/${evaluation.job_id}`, shortId(evaluation.job_id))],
    ["status", status(evaluation.status)],
  ])];
  const rows = evaluation.comparison.flatMap((score) =>
    score.inputs.length ? score.inputs.map((input) => ({ score, input })) : [{ score, input: null }]);
  if (rows.length) {
    const named = await inputNames(rows, signal);
    parts.push(table([
      ["task", (r) => r.score.task, "nowrap"],
      ["filter", (r) => r.score.filter, "nowrap"],
      ["metric", (r) => r.score.metric, "nowrap"],
      ["merge", (r) => number(r.score.value), "num"],
      ["input", (r) => (r.input ? named(r.input) : ""), "nowrap"],
      ["input's", (r) => (r.input ? number(r.input.value) : ""), "num"],
      ["difference", (r) => (r.input ? signed(r.input.difference) : ""), "num"],
      ["p-value", (r) => (r.input && r.input.paired_test ? number(r.input.paired_test.p_value, 3) : "–"), "num"],
      ["verdict", (r) => (r.input ? r.input.verdict : "")],
    ], rows, { class: "comparison" }));
  }
  return section("Evaluation", ...parts);
}

/** Each compared input by its role and the name of the checkpoint it is (its full location as
 * the title): `task: math`. */
async function inputNames(rows, signal) {
  const ids = [...new Set(rows.filter((r) => r.input).map((r) => r.input.artifact_id))];
  const found = await Promise.all(ids.map((id) => api(`/v1/artifacts/${id}`, { signal })));
  const locations = new Map(found.map((artifact) => [artifact.id, artifact.location]));
  return (input) => {
    const location = locations.get(input.artifact_id);
    return h("span", { title: location }, `${input.role}: ${location ? baseName(location) : shortId(input.artifact_id)}`);
  };
}

function signed(value) {
  return (value > 0 ? "+" : "") + number(value);
}

async function deliveries(job, signal) {
  const found = await api(`/v1/webhooks/deliveries?subject_id=${job.id}`, { signal });
  if (!found.items.length) return section("Webhook deliveries", h("p", { class: "muted" }, "None."));
  return section("Webhook deliveries", table([
    ["event", (d) => d.type],
    ["url", (d) => d.url],
    ["status", (d) => status(d.status)],
    ["attempts", (d) => (d.attempts || []).length],
    ["last error", (d) => d.last_error || ""],
    ["created", (d) => when(d.created_at)],
  ], found.items));
}
