// Building the page. Every value from the API goes in as text (textContent, attribute values),
// never as markup: a recipe name holding `<script>` shows as those characters.

const SVG = "http://www.w3.org/2000/svg";

function fill(node, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** An HTML element: h("a", {href}, "text", child…); strings become text nodes. */
export function h(tag, attrs, ...children) {
  return fill(document.createElement(tag), attrs, children);
}

/** An SVG element, as h. */
export function s(tag, attrs, ...children) {
  return fill(document.createElementNS(SVG, tag), attrs, children);
}

export function link(route, ...children) {
  return h("a", { href: "#" + route }, ...children);
}

/** The last name of a path or location: `/data/sources/math` → `math`. */
export function baseName(path) {
  return String(path).split("/").filter(Boolean).pop() || String(path);
}

export function shortId(id) {
  return id ? String(id).slice(0, 8) : "";
}

const STAMP = new Intl.DateTimeFormat(undefined, {
  year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit",
  hourCycle: "h23", timeZoneName: "short", numberingSystem: "latn",
});

/** A moment as `YYYY-MM-DD HH:MM UTC` (local time, its zone named), the full ISO as its title. */
export function when(value) {
  if (!value) return "";
  const date = new Date(value);
  if (Number.isNaN(date.getTime())) return String(value);
  const part = Object.fromEntries(STAMP.formatToParts(date).map((p) => [p.type, p.value]));
  const text = `${part.year}-${part.month}-${part.day} ${part.hour}:${part.minute} ${part.timeZoneName}`;
  return h("time", { datetime: date.toISOString(), title: value }, text);
}

export function bytes(value) {
  if (value === null || value === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let amount = Number(value);
  let unit = 0;
  while (amount >= 1024 && unit < units.length - 1) {
    amount /= 1024;
    unit += 1;
  }
  return `${amount.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

export function number(value, digits = 4) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toFixed(digits);
}

export function status(value) {
  return h("span", { class: "status status-" + value, "data-status": value }, value);
}

const STOPPED = { failed: "failed at", canceled: "canceled at" };

/** A progress bar with its percentage in words (for screen readers too), coloured by the job's
 * `state`: a failed or canceled job's bar shows where it stopped. */
export function progress(fraction, label, state = "") {
  const percent = Math.round(Math.max(0, Math.min(1, fraction || 0)) * 100);
  const words = STOPPED[state] ? `${STOPPED[state]} ${percent}%` : `${percent}%`;
  const bar = h("progress", { max: 100, value: percent, "aria-label": `${label || "progress"}: ${words}` });
  return h("span", { class: "progress", "data-fraction": fraction || 0, "data-status": state || null },
    bar, ` ${words}`);
}

/** A table: `columns` = [[heading, cell(row), class?]…]; a cell returns text or nodes; a
 * column of class "num" holds numbers (right-aligned, never wrapped). */
export function table(columns, rows, attrs = {}) {
  const head = h("tr", {}, columns.map(([title, , cls]) => h("th", { scope: "col", class: cls }, title)));
  const body = rows.map((row) => h("tr", {}, columns.map(([, cell, cls]) => h("td", { class: cls }, cell(row)))));
  return h("table", attrs, h("thead", {}, head), h("tbody", {}, body));
}

/** A titled section. */
export function section(title, ...children) {
  return h("section", { class: "card" }, h("h2", {}, title), ...children);
}

/** Key/value pairs as a definition list. */
export function facts(pairs) {
  return h(
    "dl",
    { class: "facts" },
    pairs.filter(([, v]) => v !== undefined && v !== null && v !== "").map(([k, v]) => [
      h("dt", {}, k),
      h("dd", {}, v),
    ]),
  );
}

/** An API error as the page shows it. */
export function failure(error) {
  return h("p", { class: "error", role: "alert" }, `${error.code || "error"}: ${error.message}`);
}

export function pretty(value) {
  return h("pre", { class: "json" }, JSON.stringify(value, null, 2));
}

/** Seconds as `4.2 s`, `3 min 05 s` or `2 h 07 min`. */
export function seconds(value) {
  if (value === null || value === undefined) return "";
  const whole = Math.floor(value);
  if (value < 60) return `${Number(value).toFixed(1)} s`;
  const pad = (n) => String(n).padStart(2, "0");
  if (value < 3600) return `${Math.floor(whole / 60)} min ${pad(whole % 60)} s`;
  return `${Math.floor(whole / 3600)} h ${pad(Math.floor((whole % 3600) / 60))} min`;
}

/** A job's run time: started to finished, or `running for …` while it runs (from the API's
 * `duration_s`, or its `started_at` and `finished_at`). */
export function elapsed(job) {
  if (job.duration_s !== null && job.duration_s !== undefined) return seconds(job.duration_s);
  if (!job.started_at) return "";
  const end = job.finished_at ? Date.parse(job.finished_at) : Date.now();
  const taken = seconds(Math.max(0, (end - Date.parse(job.started_at)) / 1000));
  return job.finished_at ? taken : `running for ${taken}`;
}
