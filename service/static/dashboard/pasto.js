// Shared by the dashboard pages: reading the JSON API with a read token, polling, formatting.

export const config = JSON.parse(document.getElementById("page-config").textContent);

const TOKEN_KEY = "pasto.readToken";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function storedToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

// A sign-in link (`pasto demo` prints one) carries the read token in the URL fragment, which the
// browser never sends to the server, so it stays out of access logs. The token is kept as the
// token dialog keeps it and removed from the address bar, so that it is not bookmarked, copied
// along with the address or left in the tab's history.
function takeTokenFromFragment() {
  if (!window.location.hash.startsWith("#")) return;
  const fragment = new URLSearchParams(window.location.hash.slice(1));
  const token = fragment.get("token");
  if (token === null) return;
  if (token.trim()) sessionStorage.setItem(TOKEN_KEY, token.trim());
  fragment.delete("token");
  const rest = fragment.toString();
  const { pathname, search } = window.location;
  window.history.replaceState(window.history.state, "", pathname + search + (rest ? `#${rest}` : ""));
}

takeTokenFromFragment();

let tokenRequest = null;

// Escape would close the dialog and leave the page without data and no way back: keep it open.
document.getElementById("token-dialog").addEventListener("cancel", (event) => event.preventDefault());

// Resolves with a token typed by the user. Several fetches may need one at once: they share the dialog.
function askForToken(reason) {
  if (tokenRequest) return tokenRequest;
  const dialog = document.getElementById("token-dialog");
  const form = document.getElementById("token-form");
  const input = document.getElementById("token-input");
  if (reason) document.getElementById("token-reason").textContent = reason;
  input.value = "";
  tokenRequest = new Promise((resolve) => {
    form.addEventListener("submit", () => {
      const token = input.value.trim();
      sessionStorage.setItem(TOKEN_KEY, token);
      document.getElementById("forget-token").hidden = false;
      tokenRequest = null;
      resolve(token);
    }, { once: true });
    dialog.showModal();
    input.focus();
  });
  return tokenRequest;
}

// Ask before the first request rather than after a 401: a rejected request is logged by the browser.
async function tokenForRequest() {
  if (config.anonymousRead) return null;
  return storedToken() ?? (await askForToken());
}

export async function apiGet(path) {
  for (let attempt = 0; attempt < 3; attempt += 1) {
    const token = await tokenForRequest();
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = `Bearer ${token}`;
    const response = await fetch(config.apiBase + path, { headers, cache: "no-store" });
    if (response.ok) return response.json();
    let code = "http_error";
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error) ({ code, message } = body.error);
    } catch { /* not JSON: keep the status line */ }
    if (response.status === 401 && !config.anonymousRead) {
      sessionStorage.removeItem(TOKEN_KEY);
      await askForToken(`The server did not accept that token (${message}). Enter a read token.`);
      continue;
    }
    throw new ApiError(response.status, code, message);
  }
  throw new ApiError(401, "unauthorized", "No accepted token after three attempts.");
}

export function showError(message) {
  const banner = document.getElementById("error-banner");
  banner.textContent = message;
  banner.hidden = !message;
}

// Calls `refresh` now and then every `config.pollSeconds`, without overlapping calls, skipping
// hidden tabs, and backing off (up to a minute) while the server is unreachable.
export function poll(refresh) {
  const state = document.getElementById("refresh-state");
  let failures = 0;
  async function tick() {
    if (!document.hidden) {
      try {
        await refresh();
        failures = 0;
        showError("");
        state.textContent = `Updated ${new Date().toLocaleTimeString()}`;
      } catch (error) {
        failures += 1;
        showError(error instanceof ApiError ? error.message : `Cannot reach the server (${error.message}); retrying.`);
        state.textContent = "Update failed";
      }
    }
    const delay = Math.min(60, config.pollSeconds * 2 ** Math.min(failures, 4));
    setTimeout(tick, delay * 1000);
  }
  document.getElementById("forget-token").hidden = !storedToken();
  document.getElementById("forget-token").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    window.location.reload();
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) state.textContent = "Refreshing…";
  });
  tick();
}

// --- formatting ---------------------------------------------------------------------------------

export function formatNumber(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (!Number.isFinite(value)) return value > 0 ? "∞" : "−∞";
  const magnitude = Math.abs(value);
  // Typographic minus signs: "−0.2" reads better than "-0.2" next to other figures.
  if (magnitude !== 0 && (magnitude >= 1e6 || magnitude < 1e-3)) return value.toExponential(digits - 1).replaceAll("-", "−");
  // At least `digits` significant digits, and never fewer than the integer part has.
  const significant = Math.max(digits, Math.ceil(Math.log10(magnitude + 1)));
  return value.toLocaleString("en-US", { maximumSignificantDigits: significant }).replaceAll("-", "−");
}

export function formatPercent(value) {
  if (value === null || value === undefined) return "–";
  return `${(100 * value).toFixed(value < 0.001 && value > 0 ? 2 : 1)}%`;
}

export function formatInteger(value) {
  return value === null || value === undefined ? "–" : Math.round(value).toLocaleString("en-US");
}

export function formatAge(isoTime) {
  if (!isoTime) return "never";
  const seconds = (Date.now() - Date.parse(isoTime)) / 1000;
  if (!Number.isFinite(seconds)) return "–";
  if (seconds < 0) return "just now";
  if (seconds < 90) return `${Math.round(seconds)} s ago`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 36 * 3600) return `${Math.round(seconds / 3600)} h ago`;
  return new Date(isoTime).toLocaleDateString();
}

export function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "style") node.style.cssText = value; // CSSOM: the CSP forbids style attributes
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

export function badge(text, kind) {
  return element("span", { class: `badge ${kind}` }, text);
}

// Okabe–Ito colours (distinguishable with the common colour-vision deficiencies), with Tol's wine
// instead of black, which would dominate a stacked area. Grey is "other".
export const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#882255"];
export const OTHER_COLOUR = "#9aa3b0";

export function withAlpha(hex, alpha) {
  const value = parseInt(hex.slice(1), 16);
  return `rgba(${(value >> 16) & 255}, ${(value >> 8) & 255}, ${value & 255}, ${alpha})`;
}
