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

export function shortId(id) {
  return id ? String(id).slice(0, 8) : "";
}

export function when(value) {
  if (!value) return "";
  const date = new Date(value);
  return date.toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" });
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

/** A progress bar with its percentage in words (for screen readers too). */
export function progress(fraction, label) {
  const percent = Math.round(Math.max(0, Math.min(1, fraction || 0)) * 100);
  const bar = h("progress", { max: 100, value: percent, "aria-label": label || "progress" });
  return h("span", { class: "progress", "data-fraction": fraction || 0 }, bar, ` ${percent}%`);
}

/** A table: `columns` = [[heading, cell(row)]…]; a cell returns text or nodes. */
export function table(columns, rows, attrs = {}) {
  const head = h("tr", {}, columns.map(([title]) => h("th", { scope: "col" }, title)));
  const body = rows.map((row) => h("tr", {}, columns.map(([, cell]) => h("td", {}, cell(row)))));
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
