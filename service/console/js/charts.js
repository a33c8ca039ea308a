// Hand-written SVG pictures: the plan strip, the sweep's bar chart, the analysis heatmap and
// the lineage graph. All text goes in as text nodes (dom.js).

import { h, s } from "./dom.js";

const ORIGINS = { task: "origin-task", language: "origin-language" };

/** The plan over depth: one box per layer, coloured by where it comes from. */
export function planStrip(plan) {
  const layers = plan.filter((entry) => /^\d+$/.test(String(entry.layer)));
  const strip = h("div", { class: "strip", role: "list", "aria-label": "layers, bottom to top" },
    layers.map((entry) => h("div", {
      role: "listitem",
      class: "layer " + (ORIGINS[entry.origin] || "origin-mixed"),
      title: `layer ${entry.layer}: ${entry.made_from}`,
      "data-layer": entry.layer,
      "data-origin": entry.origin,
      tabindex: 0,
    }, String(entry.layer))));
  const legend = h("div", { class: "legend" },
    [["task", "origin-task"], ["language", "origin-language"], ["mixed / other", "origin-mixed"]]
      .map(([name, cls]) => h("span", {}, h("span", { class: "swatch " + cls }), name)),
    h("span", {}, "bottom → top"));
  return h("div", {}, strip, legend);
}

const PALETTE = ["#3b6fd4", "#d9822b", "#2e9e6b", "#c2478a", "#7a5cc7", "#8a8d2b"];

/**
 * Grouped bars: `groups` (x labels) × `series` ({name, values[], errors[]}), `references`
 * ({name, value}) as dashed lines, the group at `best` marked. Hover or focus shows the value.
 */
export function barChart({ groups, series, references = [], best = -1, yLabel = "" }) {
  const width = Math.max(560, 90 * groups.length + 120);
  const height = 360;
  const margin = { left: 56, right: 120, top: 14, bottom: 90 };
  const plotW = width - margin.left - margin.right;
  const plotH = height - margin.top - margin.bottom;
  const values = [
    ...series.flatMap((one) => one.values.map((v, i) => (v ?? 0) + (one.errors[i] || 0))),
    ...references.map((r) => r.value),
  ].filter((v) => v !== null && !Number.isNaN(v));
  const highest = Math.max(0, ...values);
  const { top, digits } = yScale(highest);
  const y = (value) => margin.top + plotH - (value / top) * plotH;
  const band = plotW / Math.max(1, groups.length);
  const barW = (band * 0.8) / Math.max(1, series.length);
  const svg = s("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `${yLabel} per configuration` });
  for (let i = 0; i <= 4; i += 1) {
    const value = (top * i) / 4;
    svg.append(
      s("line", { class: "gridline", x1: margin.left, x2: margin.left + plotW, y1: y(value), y2: y(value) }),
      s("text", { x: margin.left - 6, y: y(value) + 4, "text-anchor": "end", class: "tick" },
        value.toFixed(digits)),
    );
  }
  groups.forEach((group, g) => {
    const x0 = margin.left + g * band + band * 0.1;
    const tallest = Math.max(0, ...series.map((one) => (one.values[g] ?? 0) + (one.errors[g] || 0)));
    if (g === best && tallest > 0) { // around the best group's bars; none where all are 0
      svg.append(s("rect", { class: "best", x: x0 - 3, y: y(tallest) - 4, width: band * 0.8 + 6,
        height: y(0) - y(tallest) + 4, fill: "none", "data-best": group }));
    }
    series.forEach((one, k) => {
      const value = one.values[g];
      if (value === null || value === undefined) return;
      const x = x0 + k * barW;
      const label = `${group} · ${one.name}: ${value.toFixed(4)}` +
        (one.errors[g] ? ` ± ${one.errors[g].toFixed(4)}` : "");
      svg.append(s("rect", { class: "bar", x, y: y(value), width: barW - 2, height: y(0) - y(value),
        fill: PALETTE[k % PALETTE.length], tabindex: 0, "data-config": group, "data-series": one.name,
        "data-value": value }, s("title", {}, label)));
      const error = one.errors[g];
      if (error) {
        const cx = x + (barW - 2) / 2;
        const low = Math.max(0, value - error); // a score is never below 0
        svg.append(s("path", { class: "errorbar", d: `M${cx},${y(low)}V${y(value + error)}` +
          `M${cx - 4},${y(low)}h8M${cx - 4},${y(value + error)}h8` }));
      }
    });
    svg.append(s("text", { x: x0 + band * 0.4, y: margin.top + plotH + 14, "text-anchor": "end",
      transform: `rotate(-30 ${x0 + band * 0.4} ${margin.top + plotH + 14})` }, group));
  });
  let lastLabel = -Infinity; // labels of equal scores stacked, not drawn over each other
  [...references].sort((a, b) => b.value - a.value).forEach((ref) => {
    const at = Math.max(y(ref.value) + 4, lastLabel + 13);
    lastLabel = at;
    svg.append(
      s("line", { class: "reference", x1: margin.left, x2: margin.left + plotW, y1: y(ref.value),
        y2: y(ref.value) }, s("title", {}, `${ref.name}: ${ref.value.toFixed(4)}`)),
      s("text", { x: margin.left + plotW + 4, y: at }, `${ref.name} ${ref.value.toFixed(3)}`),
    );
  });
  svg.append(
    s("line", { class: "axis", x1: margin.left, x2: margin.left, y1: margin.top, y2: margin.top + plotH }),
    s("line", { class: "axis", x1: margin.left, x2: margin.left + plotW, y1: y(0), y2: y(0) }),
    s("text", { x: 12, y: margin.top + plotH / 2, transform: `rotate(-90 12 ${margin.top + plotH / 2})`,
      "text-anchor": "middle" }, yLabel),
  );
  const legend = h("div", { class: "legend" }, series.map((one, k) =>
    h("span", {}, h("span", { class: "swatch", "data-colour": k }), one.name)));
  legend.querySelectorAll(".swatch").forEach((swatch, k) => {
    swatch.style.setProperty("background", PALETTE[k % PALETTE.length]); // CSSOM, not inline markup
  });
  const note = highest > 0 ? "" : h("p", { class: "muted chart-note" }, "Every score is 0: no configuration stands out.");
  return h("div", {}, svg, legend, note);
}

/** The y axis over 0…`highest`, in four round steps (0 to 1 where every value is 0); the
 * digits its labels need. */
function yScale(highest) {
  if (!(highest > 0)) return { top: 1, digits: 2 };
  const rough = (highest * 1.1) / 4;
  const magnitude = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((m) => m >= rough);
  let digits = 0;
  while (digits < 8 && Math.abs(Math.round(step * 10 ** digits) - step * 10 ** digits) > 1e-6) digits += 1;
  return { top: step * 4, digits };
}

/** A rows × columns heatmap; `describe(row, column, value)` is what hovering a cell shows. */
export function heatmap({ rows, columns, values, describe }) {
  const cell = 26;
  const left = 70;
  const topMargin = 10 + 5.2 * Math.max(...columns.map((name) => String(name).length)); // slanted names
  const max = Math.max(1e-12, ...values.flat());
  const svg = s("svg", { class: "chart heat", viewBox: `0 0 ${left + columns.length * cell + topMargin} ${topMargin + rows.length * cell + 10}`,
    role: "img", "aria-label": "heatmap" });
  columns.forEach((name, c) => {
    const x = left + c * cell + cell / 2;
    svg.append(s("text", { x, y: topMargin - 6, transform: `rotate(-50 ${x} ${topMargin - 6})` }, name));
  });
  const tip = h("div", { class: "tooltip", hidden: true, role: "status" });
  rows.forEach((name, r) => {
    svg.append(s("text", { x: left - 6, y: topMargin + r * cell + cell / 2 + 4, "text-anchor": "end" }, name));
    columns.forEach((column, c) => {
      const value = values[r][c];
      const text = describe(name, column, value);
      const rect = s("rect", { x: left + c * cell, y: topMargin + r * cell, width: cell - 1, height: cell - 1,
        fill: shade(value / max), tabindex: 0, "data-row": name, "data-column": column,
        "data-value": value }, s("title", {}, text));
      const show = (event) => {
        tip.textContent = text;
        tip.hidden = false;
        const box = event.type === "focus" ? rect.getBoundingClientRect() : { left: event.clientX, top: event.clientY };
        tip.style.setProperty("left", `${box.left + 12}px`);
        tip.style.setProperty("top", `${box.top + 12}px`);
      };
      rect.addEventListener("mousemove", show);
      rect.addEventListener("focus", show);
      rect.addEventListener("mouseleave", () => { tip.hidden = true; });
      rect.addEventListener("blur", () => { tip.hidden = true; });
      svg.append(rect);
    });
  });
  return h("div", {}, svg, tip);
}

function shade(fraction) {
  const t = Math.max(0, Math.min(1, fraction));
  const light = 96 - 66 * t; // one hue, light (0) to dark (the largest value)
  return `hsl(215, 70%, ${light}%)`;
}

const NODE = { w: 200, h: 46, gapX: 150, gapY: 18 };
const LABEL_LINE = 14; // an edge label's height, and the least distance between two of them

/**
 * A layered graph, left to right: `nodes` ({id, label, sub, href, kind, root}) placed in
 * `columns` (lists of ids), `edges` ({from, to, label}).
 */
export function graph({ columns, nodes, edges }) {
  const place = new Map();
  columns.forEach((ids, c) => ids.forEach((id, r) =>
    place.set(id, { x: 10 + c * (NODE.w + NODE.gapX), y: 10 + r * (NODE.h + NODE.gapY) })));
  const { paths, labels } = edgeShapes(edges, place);
  const width = 20 + columns.length * (NODE.w + NODE.gapX) - NODE.gapX;
  const height = Math.max(20 + Math.max(1, ...columns.map((ids) => ids.length)) * (NODE.h + NODE.gapY),
    ...labels.map((label) => label.y + LABEL_LINE));
  const svg = s("svg", { class: "chart graph", viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": "lineage graph" }, paths);
  for (const label of labels) {
    svg.append(s("text", { x: label.x, y: label.y, "text-anchor": "end", class: "edge-label" },
      clip(label.text, 24)));
  }
  for (const node of nodes) {
    const at = place.get(node.id);
    if (!at) continue;
    const box = s("g", { class: `node ${node.kind}${node.root ? " root" : ""}`, "data-node": node.id },
      s("rect", { x: at.x, y: at.y, width: NODE.w, height: NODE.h, rx: 6 }),
      s("text", { x: at.x + 8, y: at.y + 18, "font-weight": 600 }, clip(node.label, 28)),
      s("text", { x: at.x + 8, y: at.y + 36 }, clip(node.sub || "", 32)),
      s("title", {}, `${node.label}\n${node.sub || ""}`));
    svg.append(node.href ? s("a", { href: node.href }, box) : box);
  }
  return svg;
}

/**
 * Each edge's curve, and its label just before the node it leads to. A job fed by several
 * artifacts has its labels stacked there in its inputs' order; where labels would still touch
 * (many inputs, or an artifact feeding many jobs in one column), the lower one moves down.
 */
function edgeShapes(edges, place) {
  const paths = [];
  const into = new Map(); // the labels by the node their edge leads to
  for (const edge of edges) {
    const a = place.get(edge.from);
    const b = place.get(edge.to);
    if (!a || !b) continue;
    const x1 = a.x + NODE.w;
    const y1 = a.y + NODE.h / 2;
    const x2 = b.x;
    const y2 = b.y + NODE.h / 2;
    const mid = (x1 + x2) / 2;
    paths.push(s("path", { class: "edge", d: `M${x1},${y1}C${mid},${y1} ${mid},${y2} ${x2},${y2}` }));
    if (edge.label) {
      if (!into.has(edge.to)) into.set(edge.to, []);
      into.get(edge.to).push({ x: x2 - 6, y: y2 - 4, from: y1, text: edge.label });
    }
  }
  const labels = [];
  for (const group of into.values()) {
    group.sort((p, q) => p.from - q.from);
    group.forEach((label, k) => labels.push({ ...label, y: label.y + (k - (group.length - 1) / 2) * LABEL_LINE }));
  }
  labels.sort((p, q) => p.x - q.x || p.y - q.y);
  labels.forEach((label, i) => {
    const above = labels[i - 1];
    const least = above && above.x === label.x ? above.y + LABEL_LINE : LABEL_LINE; // below the top
    label.y = Math.max(label.y, least);
  });
  return { paths, labels };
}

function clip(text, length) {
  const value = String(text);
  return value.length > length ? value.slice(0, length - 1) + "…" : value;
}
