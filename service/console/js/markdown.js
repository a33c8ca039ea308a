// Markdown as a model card uses it, made into nodes: headings, paragraphs, lists, fenced code,
// tables, emphasis, inline code and links. No markup is parsed: every character of the text
// arrives as a text node, and a link gets its address only when that is http(s).

import { h } from "./dom.js";

const FENCE = /^\s*(```|~~~)\s*([\w+.-]*)\s*$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const RULE = /^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$/;
// `code`, [text](http…), **strong**, *em* or _em_, <http…>
const INLINE = /`([^`]+)`|\[([^\]]+)\]\(([^()\s]+)\)|\*\*(.+?)\*\*|\*([^*\s][^*]*)\*|\b_([^_]+)_\b|<(https?:\/\/[^>\s]+)>/g;

/** A card's YAML front matter (between `---` lines at its top) and the rest of it. */
export function frontMatter(text) {
  const found = /^---\r?\n([\s\S]*?)\r?\n---[ \t]*(\r?\n|$)/.exec(text);
  return found ? { meta: found[1], body: text.slice(found[0].length) } : { meta: "", body: text };
}

/** `text` as a list of nodes. Headings start at <h3> (`#`): the page has its h1 and h2. */
export function markdown(text) {
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  const nodes = [];
  let at = 0;
  while (at < lines.length) {
    if (!lines[at].trim()) {
      at += 1;
      continue;
    }
    const reader = READERS.find((read) => read.starts(lines, at)) || PARAGRAPH;
    const [node, next] = reader.read(lines, at);
    nodes.push(node);
    at = next;
  }
  return nodes;
}

const READERS = [
  { starts: (lines, at) => FENCE.test(lines[at]), read: fence },
  { starts: (lines, at) => HEADING.test(lines[at]), read: heading },
  { starts: (lines, at) => lines[at].includes("|") && RULE.test(lines[at + 1] || ""), read: table },
  { starts: (lines, at) => ITEM.test(lines[at]), read: list },
];
const PARAGRAPH = { read: paragraph };

function fence(lines, at) {
  const [, mark, language] = FENCE.exec(lines[at]);
  let end = at + 1;
  while (end < lines.length && !lines[end].trim().startsWith(mark)) end += 1;
  const code = h("code", { "data-language": language || null }, lines.slice(at + 1, end).join("\n"));
  return [h("pre", {}, code), end + 1];
}

function heading(lines, at) {
  const [, marks, text] = HEADING.exec(lines[at]);
  return [h(`h${Math.min(marks.length + 2, 6)}`, {}, inline(text)), at + 1];
}

function table(lines, at) {
  const head = cells(lines[at]);
  let end = at + 2;
  const rows = [];
  while (end < lines.length && lines[end].includes("|") && lines[end].trim()) {
    rows.push(cells(lines[end]));
    end += 1;
  }
  const node = h("table", {},
    h("thead", {}, h("tr", {}, head.map((cell) => h("th", { scope: "col" }, inline(cell))))),
    h("tbody", {}, rows.map((row) => h("tr", {}, head.map((_, i) => h("td", {}, inline(row[i] || "")))))));
  return [h("div", { class: "table-wrap" }, node), end];
}

/** A table row's cells; `\|` is a bar inside a cell. */
function cells(line) {
  let text = line.trim();
  if (text.startsWith("|")) text = text.slice(1);
  if (text.endsWith("|") && !text.endsWith("\\|")) text = text.slice(0, -1);
  return text.split(/(?<!\\)\|/).map((cell) => cell.trim().replaceAll("\\|", "|"));
}

function list(lines, at) {
  const ordered = /\d/.test(ITEM.exec(lines[at])[1]);
  const items = [];
  let end = at;
  while (end < lines.length) {
    const item = ITEM.exec(lines[end]);
    if (item && /\d/.test(item[1]) === ordered) items.push(item[2]);
    else if (/^\s+\S/.test(lines[end]) && !item) items[items.length - 1] += " " + lines[end].trim();
    else break;
    end += 1;
  }
  return [h(ordered ? "ol" : "ul", {}, items.map((text) => h("li", {}, inline(text)))), end];
}

function paragraph(lines, at) {
  let end = at + 1;
  while (end < lines.length && lines[end].trim() && !READERS.some((r) => r.starts(lines, end))) end += 1;
  return [h("p", {}, inline(lines.slice(at, end).map((line) => line.trim()).join(" "))), end];
}

/** A line's inline parts: text, code, emphasis and links, as nodes and strings. */
export function inline(text) {
  const parts = [];
  let last = 0;
  for (const found of text.matchAll(INLINE)) {
    const [whole, code, label, url, strong, em, underscored, bare] = found;
    if (found.index > last) parts.push(text.slice(last, found.index));
    if (code !== undefined) parts.push(h("code", {}, code));
    else if (label !== undefined) parts.push(anchor(url, inline(label)));
    else if (strong !== undefined) parts.push(h("strong", {}, inline(strong)));
    else if (em !== undefined || underscored !== undefined) parts.push(h("em", {}, inline(em ?? underscored)));
    else parts.push(anchor(bare, bare));
    last = found.index + whole.length;
  }
  if (last < text.length) parts.push(text.slice(last));
  return parts;
}

/** A link when `url` is http(s); any other (javascript:, data:, a relative path) is its text. */
function anchor(url, children) {
  if (!/^https?:\/\/[^\s]+$/i.test(url)) return h("span", { class: "link-refused" }, children);
  return h("a", { href: url, rel: "noreferrer noopener" }, children);
}
