// Shared by the dashboard and the explorer: DOM helpers (text only, never HTML from data), JSON, inline SVG charts.
"use strict";

const gpunet = (() => {
  const SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value !== undefined && value !== null) node.setAttribute(key, value);
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(child === undefined || child === null ? "" : String(child)));
    }
    return node;
  }

  function text(id, value) {
    const node = document.getElementById(id);
    if (node) node.textContent = value === undefined || value === null ? "" : String(value);
  }

  // Rows of a table: columns are [header, row => cell text or Node]; an empty table says so.
  function fill(id, columns, rows, empty) {
    const table = document.getElementById(id);
    table.replaceChildren();
    table.append(el("thead", {}, el("tr", {}, ...columns.map(([name]) => el("th", {}, name)))));
    const body = el("tbody");
    for (const row of rows) body.append(el("tr", {}, ...columns.map(([, cell]) => el("td", {}, cell(row)))));
    if (!rows.length) body.append(el("tr", { class: "empty" }, el("td", { colspan: columns.length }, empty || "none")));
    table.append(body);
  }

  // A definition list of [term, value] pairs.
  function facts(id, pairs) {
    const list = document.getElementById(id);
    list.replaceChildren(...pairs.flatMap(([term, value]) => [el("dt", {}, term), el("dd", {}, value)]));
  }

  // A private page's key, from the address its owner was given (after "#": never sent to a server, nor in a
  // Referer); sent with every call in a header.
  const token = new URLSearchParams(location.hash.slice(1)).get("token");
  const auth = token ? { "X-Gpunet-Token": token } : {};

  async function getJSON(path) {
    const response = await fetch(path, { cache: "no-store", headers: auth });
    if (response.status === 403) {
      const error = new Error("This page shows nothing without its key: open the address the worker logged, " +
                              "http://127.0.0.1:PORT/#token=…");
      error.keyMissing = true;
      throw error;
    }
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return response.json();
  }

  async function postJSON(path, body) {
    const response = await fetch(path, {
      method: "POST", headers: { "Content-Type": "application/json", ...auth }, body: JSON.stringify(body || {}),
    });
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return response.json();
  }

  // Credits from integer nano-credits, exactly (as the ledger prints them): two decimals at least.
  function credits(nano) {
    const negative = nano < 0;
    const digits = String(Math.abs(nano)).padStart(10, "0");
    const whole = digits.slice(0, -9);
    let frac = digits.slice(-9).replace(/0+$/, "");
    while (frac.length < 2) frac += "0";
    return `${negative ? "-" : ""}${whole}.${frac}`;
  }

  function shortId(id) { return id ? `…${id.slice(-8)}` : ""; }

  function duration(seconds) {
    if (seconds === undefined || seconds === null) return "";
    if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
    if (seconds < 120) return `${seconds.toFixed(1)} s`;
    if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
    return `${(seconds / 3600).toFixed(1)} h`;
  }

  function when(unix) {
    return unix ? new Date(unix * 1000).toLocaleString() : "";
  }

  function svgText(svg, x, y, value, anchor) {
    const label = document.createElementNS(SVG, "text");
    Object.entries({ x, y, "text-anchor": anchor || "start", class: "axis" }).forEach(([k, v]) => label.setAttribute(k, v));
    label.textContent = value;
    svg.append(label);
  }

  // Bars: points are {label, value, title}; labels along the bottom, the value's title on hover, the tallest bar's
  // value (``top``, already formatted) at the top left.
  function bars(id, points, unit, top) {
    const holder = document.getElementById(id);
    const width = 640, height = 180, pad = 28, gap = 4;
    const max = Math.max(1e-12, ...points.map(p => p.value));
    const w = (width - pad) / Math.max(1, points.length) - gap;
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", `${unit} per day`);
    points.forEach((p, i) => {
      const h = (height - pad - 8) * p.value / max;
      const x = pad + i * (w + gap), y = height - pad - h;
      const bar = document.createElementNS(SVG, "rect");
      Object.entries({ x, y, width: w, height: Math.max(h, p.value > 0 ? 1 : 0), class: "bar" })
        .forEach(([k, v]) => bar.setAttribute(k, v));
      const tip = document.createElementNS(SVG, "title");
      tip.textContent = p.title;
      bar.append(tip);
      svg.append(bar);
      if (points.length <= 16 || i % Math.ceil(points.length / 16) === 0) {
        const label = document.createElementNS(SVG, "text");
        Object.entries({ x: x + w / 2, y: height - 10, "text-anchor": "middle", class: "axis" })
          .forEach(([k, v]) => label.setAttribute(k, v));
        label.textContent = p.label;
        svg.append(label);
      }
    });
    if (top !== undefined) svgText(svg, 2, 12, top);
    holder.replaceChildren(svg);
  }

  // A line over time: points are [unix time, value]; the latest value and the span of time are written on it.
  function line(id, points, label, format) {
    const holder = document.getElementById(id);
    const width = 320, height = 110, pad = 6;  // drawn in a card a third of the page wide: text stays legible
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", label);
    if (points.length) {
      const t0 = points[0][0], t1 = points[points.length - 1][0];
      const max = Math.max(1e-12, ...points.map(p => p[1])) * 1.1;
      const xy = ([t, v]) => [pad + (width - 2 * pad) * (points.length > 1 ? (t - t0) / Math.max(1e-9, t1 - t0) : 1),
        height - pad - (height - 2 * pad - 14) * v / max];
      const stroke = document.createElementNS(SVG, "path");
      stroke.setAttribute("d", points.map((p, i) => `${i ? "L" : "M"}${xy(p).map(n => n.toFixed(1)).join(",")}`)
        .join(" "));
      stroke.setAttribute("class", "line");
      svg.append(stroke);
      const [x, y] = xy(points[points.length - 1]);
      const dot = document.createElementNS(SVG, "circle");
      Object.entries({ cx: x, cy: y, r: 3, class: "dot" }).forEach(([k, v]) => dot.setAttribute(k, v));
      svg.append(dot);
      const last = points[points.length - 1][1];
      svgText(svg, width - pad, 12, `now ${format ? format(last) : last}`, "end");
      svgText(svg, pad, 12, `over ${duration(t1 - t0)}`);
    }
    holder.replaceChildren(svg);
  }

  // Refresh, then again `seconds` after each answer (never two at once), and say when the server stops answering.
  function every(seconds, refresh) {
    const run = async () => {
      try {
        await refresh();
        text("error", "");
      } catch (e) {
        text("error", e.keyMissing ? e.message : `Not answering: ${e.message}. Trying again…`);
      }
      setTimeout(run, seconds * 1000);
    };
    run();
  }

  return { el, text, fill, facts, getJSON, postJSON, credits, shortId, duration, when, bars, line, every };
})();
