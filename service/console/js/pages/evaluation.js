// An evaluation: its scores, and its per-document samples, filtered by right or wrong; for a
// merge's evaluation, beside an input expert's answers to the same documents.

import { api, ApiError, redrawOnChange, TERMINAL } from "../api.js";
import { baseName, facts, h, link, number, progress, section, shortId, status, table, when } from "../dom.js";
import { timeline } from "../timeline.js";

export async function render({ main, id, params, signal }) {
  const job = await api(`/v1/evaluations/${id}`, { signal });
  if (!TERMINAL.has(job.status)) redrawOnChange(`/v1/evaluations/${id}`, job, signal);
  main.append(h("h1", {}, `Evaluation ${shortId(id)}`), overview(job));
  main.append(await timeline(`/v1/evaluations/${id}`, job, signal, { follow: false })); // drawn anew on change
  const scores = (job.result && job.result.scores) || [];
  if (scores.length) {
    main.append(section("Scores", table([
      ["task", (sc) => sc.task],
      ["filter", (sc) => sc.filter],
      ["metric", (sc) => sc.metric],
      ["value", (sc) => number(sc.value)],
      ["stderr", (sc) => number(sc.stderr)],
      ["samples", (sc) => sc.samples],
    ], scores, { class: "scores" })));
  }
  if (job.status === "succeeded" && job.result.samples) {
    main.append(await samplesBrowser(job, params, signal));
  } else if (!TERMINAL.has(job.status)) {
    main.append(h("p", { class: "muted" }, "Samples appear once the evaluation succeeds."));
  }
}

function overview(job) {
  const target = job.request.target || {};
  const merge = job.request.merge_job_id;
  return section("Status", facts([
    ["id", h("span", { class: "mono" }, job.id)],
    ["status", status(job.status)],
    ["progress", progress(job.progress.fraction, "evaluation progress", job.status)],
    ["model", target.artifact_id ? link(`/artifacts/${target.artifact_id}/lineage`, shortId(target.artifact_id))
      : target.source || ""],
    ["merge", merge ? link(`/merges/${merge}`, shortId(merge)) : null],
    ["tasks", (job.request.evaluation.tasks || []).join(", ")],
    ["created", when(job.created_at)],
    ["error", job.error ? h("span", { class: "error" }, `${job.error.code}: ${job.error.message}`) : null],
  ]));
}

function parseLines(text) {
  return text.split("\n").filter((line) => line.trim()).map((line) => JSON.parse(line));
}

/** The input experts' evaluations of a merge's output: [{label, job_id}], newest of each. */
async function inputEvaluations(job, signal) {
  const merge = job.request.merge_job_id;
  if (!merge) return [];
  const merged = await api(`/v1/merges/${merge}`, { signal });
  const inputs = new Map();
  for (const score of merged.result?.evaluation?.comparison || []) {
    for (const input of score.inputs) inputs.set(input.artifact_id, input);
  }
  const found = [];
  for (const [artifactId, input] of inputs) {
    const done = await withSamples(artifactId, signal);
    if (!done) continue;
    const { location } = await api(`/v1/artifacts/${artifactId}`, { signal });
    found.push({ label: `${input.role}: ${location ? baseName(location) : shortId(artifactId)}`, job_id: done });
  }
  return found;
}

/** The newest evaluation of the artifact that holds its own samples (one whose scores were
 * all reused from another holds none). */
async function withSamples(artifactId, signal) {
  const { evaluations } = await api(`/v1/artifacts/${artifactId}/evaluations`, { signal });
  for (const candidate of evaluations.filter((e) => e.status === "succeeded").slice(0, 5)) {
    const job = await api(`/v1/evaluations/${candidate.id}`, { signal });
    if (job.result.samples && job.result.ran.length) return job.id;
  }
  return null;
}

async function samplesBrowser(job, params, signal) {
  const samples = parseLines(await api(`/v1/evaluations/${job.id}/samples`, { signal, accept: "application/x-ndjson" }));
  const others = await inputEvaluations(job, signal);
  const which = params.get("show") || "all";
  const against = params.get("against") || "";
  let theirs = null;
  if (against) {
    try {
      theirs = new Map(parseLines(await api(`/v1/evaluations/${against}/samples`, { signal }))
        .map((sample) => [key(sample), sample]));
    } catch (error) {
      if (!(error instanceof ApiError)) throw error;
      theirs = null;
    }
  }
  const route = (changes) => {
    const next = new URLSearchParams({ show: which, against, ...changes });
    for (const [name, value] of [...next]) if (!value) next.delete(name);
    return `#/evaluations/${job.id}?${next}`;
  };
  const controls = h("form", { class: "toolbar" },
    h("label", {}, "documents", select("show", which, [["all", "all"], ["correct", "correct"],
      ["incorrect", "incorrect"]], (value) => { location.hash = route({ show: value }).slice(1); })),
    others.length ? h("label", {}, "beside", select("against", against, [["", "nothing"],
      ...others.map((o) => [o.job_id, o.label])], (value) => { location.hash = route({ against: value }).slice(1); })) : "");
  let shown = samples.filter((sample) => which === "all" || (which === "correct") === Boolean(sample.correct));
  if (theirs) shown = shown.filter((sample) => differs(sample, theirs.get(key(sample))));
  const list = h("div", { class: "samples" }, shown.slice(0, 500).map((sample) => sampleView(sample, theirs)));
  const note = h("p", { class: "muted" }, `${shown.length} of ${samples.length} documents` +
    (theirs ? " where the answers differ" : "") + (shown.length > 500 ? " (the first 500 shown)" : ""));
  return section("Samples", controls, note, list);
}

function select(name, value, options, onChange) {
  const element = h("select", { name }, options.map(([v, label]) => h("option", { value: v, selected: v === value }, label)));
  element.addEventListener("change", () => onChange(element.value));
  return element;
}

function key(sample) {
  return `${sample.task}\u0000${sample.filter}\u0000${sample.doc_id}`;
}

function differs(sample, other) {
  return !other || other.extracted !== sample.extracted || other.correct !== sample.correct;
}

function sampleView(sample, theirs) {
  const answer = (one, title) => h("div", {},
    h("strong", {}, title, " ", h("span", { class: one.correct ? "right" : "wrong" }, one.correct ? "✓ correct" : "✗ wrong")),
    h("pre", {}, one.response));
  const other = theirs ? theirs.get(key(sample)) : null;
  return h("div", { class: "sample", "data-doc": sample.doc_id, "data-correct": String(Boolean(sample.correct)) },
    h("div", { class: "muted" }, `${sample.task} · ${sample.filter} · document ${sample.doc_id} · target `,
      h("code", {}, String(sample.target))),
    h("pre", {}, sample.prompt),
    h("div", { class: "answers" }, answer(sample, "this model"), other ? answer(other, "the input") : ""));
}
