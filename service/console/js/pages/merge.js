// A merge: recipe, plan over depth, progress (live: a long poll that the server answers when
// the job changes), outputs with their sha256, Hub commits, MLflow version, webhook
// deliveries, and its evaluation beside its inputs'.

import { api, TERMINAL, watchJob } from "../api.js";
import { planStrip } from "../charts.js";
import {
  bytes, facts, h, link, number, pretty, progress, section, shortId, status, table, when,
} from "../dom.js";

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
      ["progress", h("span", {}, progress(p.fraction, "merge progress"),
        ` ${bytes(p.bytes_done)} / ${bytes(p.bytes_total)}, ${p.tensors_done}/${p.tensors_total} tensors`
        + (p.eta_s ? `, ETA ${Math.round(p.eta_s)} s` : ""))],
      ["attempts", job.attempts],
      ["created", when(job.created_at)],
      ["finished", when(job.finished_at)],
      ["error", job.error ? h("span", { class: "error" }, `${job.error.code}: ${job.error.message}`) : null],
    ]),
    cancel,
  );
}

async function details(job, signal) {
  const parts = [];
  if (job.plan && job.plan.length) {
    parts.push(section("Plan", planStrip(job.plan), table(
      [["layer", (e) => e.layer], ["from", (e) => e.origin], ["made from", (e) => e.made_from]],
      job.plan, { class: "plan" })));
  }
  parts.push(section("Recipe", pretty(job.request)));
  if (job.output) parts.push(outputs(job));
  const evaluation = job.result && job.result.evaluation;
  if (evaluation) parts.push(scores(evaluation));
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
    table([["file", (f) => f.name], ["sha256", (f) => h("span", { class: "mono" }, f.sha256)]],
      out.files, { class: "files" }),
  );
}

function hubLink(commit) {
  const url = commit.url;
  const label = `${commit.repo}@${commit.branch} ${shortId(commit.commit)}`;
  // Only http(s) links: a stored value must not become a javascript: URL.
  return url && /^https?:\/\//.test(url) ? h("a", { href: url, rel: "noreferrer" }, label) : label;
}

function scores(evaluation) {
  const parts = [facts([
    ["evaluation", link(`/evaluations/${evaluation.job_id}`, shortId(evaluation.job_id))],
    ["status", status(evaluation.status)],
  ])];
  const rows = evaluation.comparison.flatMap((score) =>
    score.inputs.length ? score.inputs.map((input) => ({ score, input })) : [{ score, input: null }]);
  if (rows.length) {
    parts.push(table([
      ["task", (r) => r.score.task],
      ["filter", (r) => r.score.filter],
      ["metric", (r) => r.score.metric],
      ["merge", (r) => number(r.score.value)],
      ["input", (r) => (r.input ? `${r.input.role}: ${r.input.label || shortId(r.input.artifact_id)}` : "")],
      ["input's", (r) => (r.input ? number(r.input.value) : "")],
      ["difference", (r) => (r.input ? signed(r.input.difference) : "")],
      ["p-value", (r) => (r.input && r.input.paired_test ? number(r.input.paired_test.p_value, 3) : "–")],
      ["verdict", (r) => (r.input ? r.input.verdict : "")],
    ], rows, { class: "comparison" }));
  }
  return section("Evaluation", ...parts);
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
