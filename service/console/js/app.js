// The console's router: each page is a URL fragment (#/jobs, #/merges/<id>, …), so pages can
// be bookmarked and the back button works; one module per page renders into <main>.

import { api, ApiError, forgetKey, rememberKey, storedKey } from "./api.js";
import { failure, h } from "./dom.js";
import * as analysis from "./pages/analysis.js";
import * as compare from "./pages/compare.js";
import * as create from "./pages/create.js";
import * as evaluation from "./pages/evaluation.js";
import * as executor from "./pages/executor.js";
import * as jobs from "./pages/jobs.js";
import * as lineage from "./pages/lineage.js";
import * as merge from "./pages/merge.js";
import * as sweep from "./pages/sweep.js";

// [the route, its page, what the page shows (its heading when the API has no such thing)]
const ROUTES = [
  [/^\/jobs$/, jobs, "Page"],
  [/^\/compare$/, compare, "Job"],
  [/^\/merges\/(\w+)$/, merge, "Merge"],
  [/^\/evaluations\/(\w+)$/, evaluation, "Evaluation"],
  [/^\/analyses\/(\w+)$/, analysis, "Analysis"],
  [/^\/sweeps\/(\w+)$/, sweep, "Sweep"],
  [/^\/artifacts\/(\w+)\/lineage$/, lineage, "Artifact"],
  [/^\/new\/(merge|evaluation|sweep)$/, create, "Page"],
  [/^\/executor$/, executor, "Page"],
];

const main = document.getElementById("view");
let current = null; // the shown page's AbortController: stops its streams and polls
let keyless = false; // the service answered without a key: its auth is off

function parse() {
  const [path, search] = (location.hash.slice(1) || "/jobs").split("?");
  return { path, params: new URLSearchParams(search || "") };
}

async function show() {
  if (current) current.abort();
  current = new AbortController();
  const { signal } = current;
  const { path, params } = parse();
  const found = ROUTES.map(([pattern, page, what]) => [path.match(pattern), page, what]).find(([m]) => m);
  main.replaceChildren();
  main.setAttribute("aria-busy", "true");
  document.querySelectorAll("nav a").forEach((a) => {
    a.toggleAttribute("aria-current", path.startsWith(a.getAttribute("href").slice(1)));
  });
  if (!found) {
    main.append(...notFound("Page", `No page at ${path}.`));
    main.removeAttribute("aria-busy");
    return;
  }
  const [match, page, what] = found;
  try {
    // Without a key, one read that needs one first: with auth on, it is refused and the key
    // prompt shown, even on pages that read nothing else needing a key (the forms).
    if (!keyless && !storedKey()) {
      await api("/v1/merges?limit=1", { signal });
      keyless = true;
    }
    await page.render({ main, id: match[1], params, signal });
  } catch (error) {
    if (signal.aborted) return;
    if (error instanceof ApiError && error.status === 401) {
      // not aborted: the refusal's own prompt did not reach this page, so ask here
      window.dispatchEvent(new CustomEvent("layerswap:unauthorized"));
      return;
    }
    // A 404 before the page drew anything: what the page shows is not there.
    const missing = error instanceof ApiError && error.status === 404 && !main.childElementCount;
    main.append(...(missing ? notFound(what, error.message) : [failure(error)]));
  } finally {
    if (!signal.aborted) {
      main.removeAttribute("aria-busy");
      performance.mark("layerswap:rendered", { detail: path }); // read by bench/console.py
    }
  }
  main.focus({ preventScroll: true });
}

/** A page for what is not there: what (a merge, an artifact…), the API's words, the way back. */
function notFound(what, message) {
  return [
    h("h1", {}, `${what} not found`),
    h("p", { class: "error", role: "alert" }, message),
    h("p", {}, h("a", { href: "#/jobs" }, "Back to the jobs list")),
  ];
}

/** With auth on: ask for a key (kept in this tab's sessionStorage), then show the page. */
function askForKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = dialog.querySelector("input");
  dialog.querySelector(".why").textContent = message;
  input.value = "";
  if (!dialog.open) dialog.showModal();
  input.focus();
}

function setUp() {
  const dialog = document.getElementById("key-dialog");
  dialog.querySelector("form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = dialog.querySelector("input").value.trim();
    if (!key) return;
    rememberKey(key);
    dialog.close();
    updateSignOut();
    show();
  });
  dialog.addEventListener("cancel", (event) => event.preventDefault()); // no data without a key
  window.addEventListener("layerswap:unauthorized", () => {
    if (current) current.abort();
    main.replaceChildren(h("p", { class: "muted" }, "An API key is needed to see this page."));
    askForKey(storedKey() ? "That key was refused. Enter another API key." : "This service needs an API key.");
  });
  document.getElementById("sign-out").addEventListener("click", () => {
    forgetKey();
    updateSignOut();
    show();
  });
  window.addEventListener("hashchange", show);
  // Leaving the page (or its going into the back/forward cache) closes its streams: open
  // ones would hold connections the next page needs. Back again, it is drawn afresh.
  window.addEventListener("pagehide", () => current && current.abort());
  window.addEventListener("pageshow", (event) => event.persisted && show());
  updateSignOut();
  show();
}

function updateSignOut() {
  document.getElementById("sign-out").hidden = !storedKey();
}

setUp();
