// Create forms: a merge (its parameters from GET /v1/methods; with `?from=<id>`, filled in with
// that merge's request, to run it again as it was or edited), an evaluation, a sweep from a
// preset. The API checks everything; its errors are shown beside the field they name.

import { api, ApiError } from "../api.js";
import { h } from "../dom.js";

const DTYPES = ["auto", "float32", "bfloat16", "float16"];

export async function render({ main, id, params, signal }) {
  const forms = { merge: mergeForm, evaluation: evaluationForm, sweep: sweepForm };
  main.append(h("h1", {}, `New ${id}`), await forms[id](params, signal));
}

async function mergeForm(params, signal) {
  const methods = await api("/v1/methods", { signal });
  const from = params.get("from");
  const earlier = from ? (await api(`/v1/merges/${from}`, { signal })).request : null;
  const chosen = methods.find((m) => m.method === (params.get("method") || earlier?.method)) || methods[0];
  const fields = [
    { name: "method", label: "method", kind: "select", options: methods.map((m) => m.method), value: chosen.method,
      hint: chosen.summary },
    ...(chosen.inputs === "experts"
      ? [{ name: "experts.task", label: "task experts", kind: "lines", hint: "one source per line" },
        { name: "experts.language", label: "language experts", kind: "lines", hint: "one source per line" }]
      : [{ name: "models", label: "models", kind: "lines", hint: "one source per line" }]),
    ...(chosen.base !== "unused" ? [{ name: "base", label: `base (${chosen.base})`, kind: "text" }] : []),
    ...Object.entries(chosen.params).map(([name, schema]) => paramField(name, schema)),
    { name: "output.name", label: "output name", kind: "text", hint: "default: made from the job id" },
  ];
  if (earlier && earlier.method === chosen.method) fields.push(prefill(fields, earlier));
  const form = build(fields, "Submit merge", (body) => api("/v1/merges", { method: "POST", body }),
    (job) => `/merges/${job.id}`);
  form.querySelector("[name=method]").addEventListener("change", (event) => {
    location.hash = `/new/merge?method=${encodeURIComponent(event.target.value)}`;
  });
  return form;
}

// What a merge's stored request holds beside what a new one may send: the mergekit config it
// was translated from (its recipe, which ran, is sent instead) and its sweep trial.
const NOT_SENT = ["mergekit", "sweep"];

/** Fill `fields` in from an earlier request (all but its output name, which names that
 * output); the field for the rest of it, as JSON, sent with the others. */
function prefill(fields, request) {
  const rest = structuredClone(request);
  for (const key of NOT_SENT) delete rest[key];
  for (const field of fields) {
    const value = take(rest, field.name.split("."));
    if (value === undefined || value === null || field.name === "output.name") continue;
    if (field.kind === "lines") field.value = [value].flat().join("\n");
    else if (field.json) field.value = JSON.stringify(value);
    else field.value = String(value);
  }
  const name = request.output && request.output.name;
  if (name) fields.find((f) => f.name === "output.name").hint = `was ${name}: a new name, or empty for one made from the job id`;
  return { name: "rest", label: "the rest of the request", kind: "object", value: JSON.stringify(pruned(rest) || {}, null, 2),
    hint: "JSON, sent with the fields above (which win)" };
}

/** The value at `path` in `data`, removed from it. */
function take(data, path) {
  const parent = path.slice(0, -1).reduce((at, key) => (at && typeof at === "object" ? at[key] : undefined), data);
  if (!parent || typeof parent !== "object") return undefined;
  const value = parent[path[path.length - 1]];
  delete parent[path[path.length - 1]];
  return value;
}

/** `value` less its nulls and emptied objects (undefined when nothing is left). */
function pruned(value) {
  if (value === null) return undefined;
  if (typeof value !== "object" || Array.isArray(value)) return value;
  const kept = Object.entries(value).map(([k, v]) => [k, pruned(v)]).filter(([, v]) => v !== undefined);
  return kept.length ? Object.fromEntries(kept) : undefined;
}

function isObject(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}

/** `base` with `over` laid on it, object by object. */
function overlaid(base, over) {
  const out = { ...base };
  for (const [key, value] of Object.entries(over)) {
    out[key] = isObject(value) && isObject(out[key]) ? overlaid(out[key], value) : value;
  }
  return out;
}

/** A method parameter's field, from its JSON Schema: numbers, choices, or JSON. */
function paramField(name, schema) {
  const base = { name: `params.${name}`, label: name, hint: schema.description || "" };
  const shown = schema.default === undefined ? "" : JSON.stringify(schema.default);
  if (schema.enum) return { ...base, kind: "select", options: ["", ...schema.enum], placeholder: shown };
  if (schema.type === "integer" || schema.type === "number") {
    return { ...base, kind: "number", step: schema.type === "integer" ? 1 : "any", placeholder: shown };
  }
  if (schema.type === "boolean") return { ...base, kind: "select", options: ["", "true", "false"], json: true };
  return { ...base, kind: "text", json: true, placeholder: shown, hint: (base.hint + " (JSON)").trim() };
}

function evaluationForm() {
  const fields = [
    { name: "artifact_id", label: "artifact id", kind: "text", hint: "an artifact, or a source below" },
    { name: "source", label: "source", kind: "text", hint: "a local source or hf://org/name" },
    ...evaluationFields("evaluation"),
  ];
  return build(fields, "Submit evaluation", (body) => api("/v1/evaluations", { method: "POST", body }),
    (job) => `/evaluations/${job.id}`);
}

function evaluationFields(prefix) {
  return [
    { name: `${prefix}.tasks`, label: "tasks", kind: "list", hint: "comma-separated lm-eval task names" },
    { name: `${prefix}.num_fewshot`, label: "few-shot examples", kind: "number", step: 1, placeholder: "8" },
    { name: `${prefix}.limit`, label: "documents per task", kind: "number", step: 1, placeholder: "all" },
    { name: `${prefix}.max_gen_toks`, label: "max generated tokens", kind: "number", step: 1, placeholder: "256" },
    { name: `${prefix}.batch_size`, label: "batch size", kind: "number", step: 1, placeholder: "8" },
    { name: `${prefix}.dtype`, label: "dtype", kind: "select", options: ["", ...DTYPES] },
  ];
}

function sweepForm() {
  const fields = [
    { name: "preset", label: "preset", kind: "select", options: ["paper-default", "swap-ablation"] },
    { name: "task_experts", label: "task experts", kind: "lines", hint: "one source per line" },
    { name: "language_experts", label: "language experts", kind: "lines", hint: "one source per line" },
    { name: "base", label: "base", kind: "text" },
    ...evaluationFields("evaluation"),
    { name: "objective.task", label: "objective task", kind: "text", hint: "one of the tasks" },
    { name: "objective.metric", label: "objective metric", kind: "text", placeholder: "exact_match" },
    { name: "budget", label: "job budget", kind: "number", step: 1, placeholder: "200" },
  ];
  return build(fields, "Submit sweep", (body) => api("/v1/sweeps", { method: "POST", body }),
    (sweep) => `/sweeps/${sweep.id}`);
}

function control(field) {
  const id = "f-" + field.name.replaceAll(".", "-");
  const common = { id, name: field.name, "data-field": field.name, "aria-describedby": `${id}-error` };
  if (field.kind === "select") {
    return h("select", common, field.options.map((o) =>
      h("option", { value: o, selected: o === field.value }, o || `default${field.placeholder ? " " + field.placeholder : ""}`)));
  }
  if (field.kind === "lines") return h("textarea", { ...common, rows: 2 }, field.value || "");
  if (field.kind === "object") return h("textarea", { ...common, rows: 8, class: "mono" }, field.value || "");
  return h("input", { ...common, type: field.kind === "number" ? "number" : "text", step: field.step,
    placeholder: field.placeholder, value: field.value });
}

function build(fields, submitLabel, send, next) {
  const form = h("form", { class: "create card", novalidate: true });
  const general = h("p", { class: "error", role: "alert", hidden: true });
  for (const field of fields) {
    const input = control(field);
    form.append(h("div", { class: "field" },
      h("label", { for: input.id }, field.label), input,
      field.hint ? h("p", { class: "hint" }, field.hint) : "",
      h("p", { class: "field-error", id: `${input.id}-error`, "data-error-for": field.name, hidden: true })));
  }
  const button = h("button", { type: "submit", class: "primary" }, submitLabel);
  form.append(general, button);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors(form, general);
    let body;
    try {
      body = collect(form, fields);
    } catch (error) {
      showError(form, general, error.field, error.message);
      return;
    }
    button.disabled = true;
    try {
      const made = await send(body);
      location.hash = next(made);
    } catch (error) {
      if (!(error instanceof ApiError)) throw error;
      const problems = error.details.problems || [{ field: error.details.field, message: error.message }];
      for (const problem of problems) showError(form, general, problem.field, problem.message);
    } finally {
      button.disabled = false;
    }
  });
  return form;
}

/** The request body: dotted names become nested objects; empty fields are left out. */
function collect(form, fields) {
  const body = {};
  let rest = {};
  for (const field of fields) {
    const raw = form.elements[field.name].value.trim();
    if (raw === "") continue;
    if (field.kind === "object") {
      rest = parsedObject(raw, field.name);
      continue;
    }
    let value = raw;
    if (field.kind === "number") value = Number(raw);
    else if (field.kind === "lines") value = raw.split("\n").map((line) => line.trim()).filter(Boolean);
    else if (field.kind === "list") value = raw.split(",").map((item) => item.trim()).filter(Boolean);
    else if (field.json) {
      try {
        value = JSON.parse(raw);
      } catch {
        value = raw; // a plain word (e.g. "uniform"): the API says whether it is one it takes
      }
    }
    const path = field.name.split(".");
    let at = body;
    for (const part of path.slice(0, -1)) at = at[part] ||= {};
    at[path[path.length - 1]] = value;
  }
  return overlaid(rest, body);
}

function parsedObject(raw, name) {
  let value;
  try {
    value = JSON.parse(raw);
  } catch (error) {
    value = undefined;
  }
  if (!isObject(value)) throw Object.assign(new Error("a JSON object: {\"key\": value, …}"), { field: name });
  return value;
}

function clearErrors(form, general) {
  general.hidden = true;
  form.querySelectorAll(".field-error").forEach((p) => { p.hidden = true; p.textContent = ""; });
  form.querySelectorAll("[aria-invalid]").forEach((e) => e.removeAttribute("aria-invalid"));
}

/** Beside the field the error names (or the nearest field it lies in), else above the button. */
function showError(form, general, field, message) {
  const names = [...form.querySelectorAll("[data-field]")].map((e) => e.dataset.field);
  // The field itself, else the field it lies in (experts.task.0 in experts.task), else the
  // first field lying in it (params: params.bottom).
  const within = names.filter((name) => field && (field === name || field.startsWith(name + ".")))
    .sort((a, b) => b.length - a.length);
  const target = within[0] || names.find((name) => field && name.startsWith(field + "."));
  if (!target) {
    general.hidden = false;
    general.textContent = (general.textContent ? general.textContent + "\n" : "") + message;
    return;
  }
  const slot = form.querySelector(`[data-error-for="${CSS.escape(target)}"]`);
  slot.hidden = false;
  slot.textContent = (slot.textContent ? slot.textContent + "\n" : "") + message;
  form.querySelector(`[data-field="${CSS.escape(target)}"]`).setAttribute("aria-invalid", "true");
}
