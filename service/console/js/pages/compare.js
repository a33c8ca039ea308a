// Compare: merges, or evaluations, side by side (#/compare?kind=merge&ids=a,b), a column per
// job and a row per value: a merge's status, run time, method, parameters, sources and output
// files (sha256, size); an evaluation's model and its score for each task and metric. Rows
// whose values differ between the jobs are marked.

import { api, ApiError, COLLECTION } from "../api.js";
import { bytes, elapsed, h, link, number, section, shortId, status } from "../dom.js";

const MOST = 8; // jobs compared at once: each is one request, and a column
const KINDS = ["merge", "evaluation"];
// The parts of a merge's request that name its sources.
const SOURCE_FIELDS = ["base", "experts", "models", "slices", "tokenizer_source"];

export async function render({ main, params, signal }) {
  const ids = [...new Set((params.get("ids") || "").split(",").map((id) => id.trim()).filter(Boolean))];
  main.append(h("h1", {}, "Compare"));
  if (ids.length < 2 || ids.length > MOST) {
    main.append(h("p", { class: "error", role: "alert" },
      `Give two to ${MOST} job ids to compare: #/compare?ids=a,b`));
    return;
  }
  const kind = KINDS.includes(params.get("kind")) ? params.get("kind") : await kindOf(ids[0], signal);
  const jobs = await Promise.all(ids.map((id) => api(`/v1/${COLLECTION[kind]}/${id}`, { signal })));
  const rows = kind === "merge" ? await mergeRows(jobs, signal) : evaluationRows(jobs);
  main.append(section(`${jobs.length} ${kind === "merge" ? "merges" : "evaluations"}`,
    h("div", { class: "table-wrap" }, sideBySide(kind, jobs, rows))));
}

/** A job's kind, for a shared URL that names ids only: a merge, or else an evaluation. */
async function kindOf(id, signal) {
  try {
    await api(`/v1/merges/${id}`, { signal });
    return "merge";
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) return "evaluation";
    throw error;
  }
}

/** The table: `rows` = [[label, [value per job]]…]; a value is text, or [text, node]. */
function sideBySide(kind, jobs, rows) {
  const head = h("tr", {}, h("th", { scope: "col" }, ""), jobs.map((job) =>
    h("th", { scope: "col", "data-job": job.id },
      link(`/${COLLECTION[kind]}/${job.id}`, shortId(job.id)))));
  const body = rows.map(([label, values]) => {
    const texts = values.map((value) => (Array.isArray(value) ? value[0] : value ?? ""));
    const differs = new Set(texts).size > 1;
    return h("tr", { class: differs ? "differs" : null, "data-row": label },
      h("th", { scope: "row" }, label, differs ? h("span", { class: "visually-hidden" }, " (differs)") : ""),
      values.map((value) => h("td", { class: "mono" }, Array.isArray(value) ? value[1] : value ?? "")));
  });
  return h("table", { class: "compare" }, h("thead", {}, head), h("tbody", {}, body));
}

/** Every key of `objects` (in first-seen order), to give each job a row per key. */
function keysOf(objects) {
  return [...new Set(objects.flatMap((object) => Object.keys(object || {})))];
}

/** Nested values flattened to `a.b[0]` paths: one row per leaf. */
function flatten(value, prefix, into = {}) {
  if (Array.isArray(value)) value.forEach((item, i) => flatten(item, `${prefix}[${i}]`, into));
  else if (value && typeof value === "object") {
    for (const [key, item] of Object.entries(value)) flatten(item, prefix ? `${prefix}.${key}` : key, into);
  } else if (value !== null && value !== undefined) into[prefix] = String(value);
  return into;
}

function rowsFrom(prefix, objects) {
  return keysOf(objects).map((key) => [`${prefix}${key}`, objects.map((o) => (o ? o[key] : ""))]);
}

async function mergeRows(jobs, signal) {
  const artifacts = await Promise.all(jobs.map((job) =>
    (job.output ? api(`/v1/artifacts/${job.output.artifact_id}`, { signal }) : null)));
  const sources = jobs.map((job) => ({
    ...flatten(Object.fromEntries(SOURCE_FIELDS.map((f) => [f, job.request[f]]))),
    ...Object.fromEntries(job.sources.map((s, i) => [`hub: ${s.field}`, `${s.repo}@${s.sha}`])),
  }));
  const files = artifacts.map((artifact) =>
    Object.fromEntries((artifact ? artifact.files : []).map((file) => [file.name, file.sha256])));
  return [
    ["status", jobs.map((job) => [job.status, status(job.status)])],
    ["duration", jobs.map(elapsed)],
    ["method", jobs.map((job) => job.request.method)],
    ["name", jobs.map((job) => (job.output ? job.output.name : job.request.output?.name) || "")],
    ...rowsFrom("params.", jobs.map((job) => flatten(job.request.params || {}, ""))),
    ...rowsFrom("source: ", sources),
    ["output size", artifacts.map((a) => (a ? [String(a.size_bytes), bytes(a.size_bytes)] : ""))],
    ...rowsFrom("sha256: ", files).map(([label, values]) =>
      [label, values.map((sha) => (sha ? [sha, h("span", { title: sha }, sha.slice(0, 12))] : ""))]),
  ];
}

function evaluationRows(jobs) {
  const scores = jobs.map((job) => Object.fromEntries(((job.result && job.result.scores) || []).map(
    (score) => [`${score.task} · ${score.filter} · ${score.metric}`, score])));
  const target = (job) => {
    const found = job.request.target || {};
    return found.source || (found.artifact_id && `artifact ${shortId(found.artifact_id)}`) ||
      (found.layer_swap ? "layer swap" : "");
  };
  return [
    ["status", jobs.map((job) => [job.status, status(job.status)])],
    ["duration", jobs.map(elapsed)],
    ["model", jobs.map(target)],
    ["merge", jobs.map((job) => job.request.merge_job_id || "")],
    ...keysOf(scores).map((key) => [key, scores.map((found) => {
      const score = found[key];
      if (!score) return "";
      const text = number(score.value) + (score.stderr === null || score.stderr === undefined ? ""
        : ` ± ${number(score.stderr)}`);
      return [text, text];
    })]),
  ];
}
