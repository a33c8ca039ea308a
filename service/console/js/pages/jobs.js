// Jobs: every kind in one list (GET /v1/jobs), filtered and paged by the URL's query; live
// while anything on the page runs: the event streams of its running merges, and a re-read of
// the page (one request, one page) when they or the clock say something changed.

import { api, COLLECTION, followEvents, query, TERMINAL } from "../api.js";
import { h, link, progress, shortId, status, when } from "../dom.js";

const KINDS = ["", "merge", "evaluation", "analysis", "sweep"];
const STATUSES = ["", "queued", "running", "canceling", "succeeded", "failed", "canceled"];
const CANCELABLE = new Set(["merge", "evaluation", "sweep"]);
const STREAMS = 3; // event streams held open at once (the API counts them per tenant)
const REREAD_MS = 2000; // the page's own re-read while something on it has not ended

export async function render({ main, params, signal }) {
  const filters = {
    kind: params.get("kind") || "",
    status: params.get("status") || "",
    q: params.get("q") || "",
  };
  const cursor = params.get("cursor") || "";
  const limit = params.get("limit") || ""; // the API's default page size unless the URL says
  main.append(h("h1", {}, "Jobs"), filterBar(filters));
  const listing = h("div", { class: "card", id: "jobs" });
  main.append(listing);
  const read = () => api("/v1/jobs" + query({ ...filters, cursor, limit }), { signal });
  let page = await read();
  const rows = new Map();
  const paging = { ...filters, limit };
  listing.replaceChildren(jobTable(page.items, rows), pager(paging, cursor, page.next_cursor));
  live(page, signal, async () => {
    page = await read();
    const same = page.items.length === rows.size && page.items.every((job) => rows.has(job.id));
    if (same) page.items.forEach((job) => rows.get(job.id).update(job));
    else {
      rows.clear();
      listing.replaceChildren(jobTable(page.items, rows), pager(paging, cursor, page.next_cursor));
    }
    return page;
  });
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

function jobTable(items, rows) {
  if (!items.length) return h("p", { class: "muted" }, "No jobs.");
  const body = h("tbody");
  for (const job of items) {
    const row = jobRow(job);
    rows.set(job.id, row);
    body.append(row.element);
  }
  const headings = ["Job", "Kind", "Name", "Status", "Progress", "Created", ""];
  return h("table", { class: "jobs" },
    h("thead", {}, h("tr", {}, headings.map((t, i) =>
      h("th", { scope: "col", class: i === 5 ? "hide-narrow" : null }, t)))),
    body);
}

function jobRow(job) {
  const cells = {
    status: h("td"),
    progress: h("td"),
    action: h("td"),
    detail: h("div", { class: "muted" }),
  };
  const element = h(
    "tr",
    { "data-job": job.id, "data-kind": job.kind },
    h("td", { class: "mono" }, link(`/${COLLECTION[job.kind]}/${job.id}`, shortId(job.id))),
    h("td", { class: "nowrap" }, job.kind),
    h("td", {}, h("div", { class: "name" }, job.name || ""), cells.detail),
    cells.status,
    cells.progress,
    h("td", { class: "hide-narrow nowrap" }, when(job.created_at)),
    cells.action,
  );
  const update = (fresh) => {
    cells.status.replaceChildren(status(fresh.status));
    cells.progress.replaceChildren(progress(fresh.progress.fraction, `progress of ${fresh.id}`));
    const detail = fresh.error ? fresh.error.message : fresh.stage || "";
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

function pager(filters, cursor, next) {
  return h(
    "div",
    { class: "pager" },
    cursor ? link("/jobs" + query(filters), "First page") : "",
    next ? link("/jobs" + query({ ...filters, cursor: next }), "Next page") : "",
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
