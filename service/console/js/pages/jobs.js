// Jobs: every kind in one list (GET /v1/jobs), filtered, sorted (by a column's heading) and
// paged both ways by the URL's query, with the count of all it matches; live while anything on
// the page runs: the event streams of its running merges, and a re-read of the page (one
// request, one page) when they or the clock say something changed. Merges or evaluations
// ticked in the list open side by side (#/compare).

import { api, COLLECTION, followEvents, query, TERMINAL } from "../api.js";
import { elapsed, h, link, progress, shortId, status, when } from "../dom.js";

const KINDS = ["", "merge", "evaluation", "analysis", "sweep"];
const STATUSES = ["", "queued", "running", "canceling", "succeeded", "failed", "canceled"];
const CANCELABLE = new Set(["merge", "evaluation", "sweep"]);
const STREAMS = 3; // event streams held open at once (the API counts them per tenant)
const REREAD_MS = 2000; // the page's own re-read while something on it has not ended
const COMPARABLE = new Set(["merge", "evaluation"]);
// [heading, the API's sort field (none: not sortable), class]
const COLUMNS = [
  ["Job", null], ["Kind", "kind"], ["Name", "name"], ["Method", "method"], ["Status", "status"],
  ["Progress", null], ["Duration", "duration"], ["Created", "created_at", "hide-narrow"], ["", null],
];
const NEWEST_FIRST = { sort: "created_at", order: "desc" };

export async function render({ main, params, signal }) {
  const filters = {
    kind: params.get("kind") || "",
    status: params.get("status") || "",
    q: params.get("q") || "",
  };
  const order = {
    sort: params.get("sort") || NEWEST_FIRST.sort,
    order: params.get("order") || NEWEST_FIRST.order,
  };
  const at = { cursor: params.get("cursor") || "", before: params.get("before") || "" };
  const limit = params.get("limit") || ""; // the API's default page size unless the URL says
  const selected = new Map(); // ticked job id -> kind, kept while the list redraws
  const compare = comparer(selected);
  const count = h("p", { class: "muted", id: "jobs-total" });
  const bar = filterBar(filters);
  if (params.get("sort")) { // filtering keeps the order
    bar.append(...Object.entries(order).map(([name, value]) => h("input", { type: "hidden", name, value })));
  }
  main.append(h("h1", {}, "Jobs"), bar, compare.element, count);
  const listing = h("div", { class: "card", id: "jobs" });
  main.append(listing);
  const paging = { ...filters, limit };
  const read = () => api("/v1/jobs" + query({ ...filters, ...order, ...at, limit }), { signal });
  const rows = new Map();
  const draw = (page) => {
    rows.clear();
    const table = jobTable(page.items, rows, { paging, order, selected, changed: compare.update });
    listing.replaceChildren(table, pager({ ...paging, ...order }, at, page));
  };
  let page = await read();
  count.textContent = total(page.total);
  draw(page);
  live(page, signal, async () => {
    page = await read();
    count.textContent = total(page.total);
    const same = page.items.length === rows.size && page.items.every((job) => rows.has(job.id));
    if (same) page.items.forEach((job) => rows.get(job.id).update(job));
    else draw(page);
    return page;
  });
}

function total(count) {
  return `${count} ${count === 1 ? "job" : "jobs"}`;
}

/** The Compare button: on when two or more jobs of one comparable kind are ticked. */
function comparer(selected) {
  const button = h("button", { type: "button", id: "compare", disabled: true }, "Compare");
  const hint = h("span", { class: "muted" });
  const update = () => {
    const kinds = new Set(selected.values());
    const ready = selected.size >= 2 && kinds.size === 1;
    button.disabled = !ready;
    hint.textContent = selected.size && !ready ? "tick two or more merges, or two or more evaluations" : "";
  };
  button.addEventListener("click", () => {
    const [kind] = selected.values();
    location.hash = "/compare" + query({ kind, ids: [...selected.keys()].join(",") });
  });
  update();
  return { element: h("div", { class: "toolbar", id: "compare-bar" }, button, hint), update };
}

function filterBar(filters) {
  const choice = (name, options) =>
    h("label", {}, name, h("select", { name }, options.map((o) =>
      h("option", { value: o, selected: o === filters[name] }, o || "any"))));
  const form = h(
    "form",
    { class: "toolbar", role: "search" },
    choice("kind", KINDS),
    choice("status", STATUSES),
    h("label", {}, "text", h("input", { name: "q", type: "search", value: filters.q,
      placeholder: "id or name" })),
    h("button", { type: "submit" }, "Filter"),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const values = Object.fromEntries(new FormData(form));
    location.hash = "/jobs" + query(values);
  });
  form.querySelectorAll("select").forEach((select) =>
    select.addEventListener("change", () => form.requestSubmit()));
  return form;
}

function jobTable(items, rows, { paging, order, selected, changed }) {
  if (!items.length) return h("p", { class: "muted" }, "No jobs.");
  const body = h("tbody");
  for (const job of items) {
    const row = jobRow(job, tickBox(job, selected, changed));
    rows.set(job.id, row);
    body.append(row.element);
  }
  return h("table", { class: "jobs" },
    h("thead", {}, h("tr", {}, COLUMNS.map(([title, field, cls]) => heading(title, field, cls, paging, order)))),
    body);
}

/** A column's heading; a sortable one links to the list sorted by it (again: the other way). */
function heading(title, field, cls, paging, order) {
  if (!field) return h("th", { scope: "col", class: cls }, title);
  const current = order.sort === field;
  const first = field === "created_at" || field === "duration" ? "desc" : "asc";
  const next = current ? (order.order === "desc" ? "asc" : "desc") : first;
  const sorted = current ? (order.order === "desc" ? "descending" : "ascending") : null;
  return h("th", { scope: "col", class: cls, "aria-sort": sorted, "data-sort": field },
    link("/jobs" + query({ ...paging, sort: field, order: next }), title,
      current ? (order.order === "desc" ? " ▼" : " ▲") : ""));
}

/** A merge's or an evaluation's tick box, to compare it; nothing for other kinds. */
function tickBox(job, selected, changed) {
  if (!COMPARABLE.has(job.kind)) return "";
  const box = h("input", { type: "checkbox", name: "select", value: job.id,
    checked: selected.has(job.id), "aria-label": `select ${job.id} to compare` });
  box.addEventListener("change", () => {
    if (box.checked) selected.set(job.id, job.kind);
    else selected.delete(job.id);
    changed();
  });
  return box;
}

function jobRow(job, tick) {
  const cells = {
    status: h("td"),
    progress: h("td"),
    duration: h("td", { class: "nowrap duration" }),
    action: h("td"),
    detail: h("div", { class: "muted" }),
  };
  const element = h(
    "tr",
    { "data-job": job.id, "data-kind": job.kind },
    h("td", { class: "mono nowrap" }, tick, link(`/${COLLECTION[job.kind]}/${job.id}`, shortId(job.id))),
    h("td", { class: "nowrap" }, job.kind),
    h("td", {}, h("div", { class: "name" }, job.name || ""), cells.detail),
    h("td", { class: "method" }, job.method || ""),
    cells.status,
    cells.progress,
    cells.duration,
    h("td", { class: "hide-narrow nowrap" }, when(job.created_at)),
    cells.action,
  );
  const update = (fresh) => {
    cells.status.replaceChildren(status(fresh.status));
    cells.progress.replaceChildren(progress(fresh.progress.fraction, `progress of ${fresh.id}`, fresh.status));
    const detail = fresh.error ? fresh.error.message : fresh.stage || "";
    cells.duration.textContent = elapsed(fresh);
    cells.detail.textContent = detail;
    cells.detail.className = fresh.error ? "error" : "muted";
    cells.action.replaceChildren(
      CANCELABLE.has(fresh.kind) && !TERMINAL.has(fresh.status) && fresh.status !== "canceling"
        ? cancelButton(fresh, update)
        : "",
    );
  };
  update(job);
  return { element, update };
}

function cancelButton(job, update) {
  const button = h("button", { type: "button", class: "danger", "aria-label": `cancel ${job.id}` },
    "Cancel");
  button.addEventListener("click", async () => {
    button.disabled = true;
    try {
      const answer = await api(`/v1/${COLLECTION[job.kind]}/${job.id}/cancel`, { method: "POST" });
      update({ ...job, status: answer.status });
    } catch (error) {
      button.replaceWith(h("span", { class: "error" }, error.message));
    }
  });
  return button;
}

function pager(paging, at, page) {
  return h(
    "div",
    { class: "pager" },
    at.cursor || at.before ? link("/jobs" + query(paging), "First page") : "",
    page.prev_cursor ? link("/jobs" + query({ ...paging, before: page.prev_cursor }), "Previous page") : "",
    page.next_cursor ? link("/jobs" + query({ ...paging, cursor: page.next_cursor }), "Next page") : "",
  );
}

/** Keep `page` current until `signal` aborts: `reread()` returns the page read again. */
function live(page, signal, reread) {
  const tried = new Set(); // each job's stream once: a refused one is not asked again
  let open = 0;
  let pending = null;
  const soon = () => {
    if (pending || signal.aborted) return;
    pending = setTimeout(async () => {
      pending = null;
      try {
        page = await reread();
        follow();
      } catch (error) {
        // the next round tries again; a lost key shows the key prompt
      }
    }, 250);
  };
  const follow = () => {
    for (const job of page.items) {
      if (open >= STREAMS) break;
      if (job.kind !== "merge" || job.status !== "running" || tried.has(job.id)) continue;
      tried.add(job.id);
      open += 1;
      followEvents(`/v1/merges/${job.id}/events`, soon, signal).finally(() => {
        open -= 1;
        soon();
      });
    }
  };
  follow();
  const timer = setInterval(() => {
    if (page.items.some((job) => !TERMINAL.has(job.status))) soon();
  }, REREAD_MS);
  signal.addEventListener("abort", () => {
    clearInterval(timer);
    clearTimeout(pending);
  });
}
