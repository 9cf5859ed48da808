// The network explorer: /api/network every five seconds.
"use strict";

(() => {
  const g = gpunet;

  function best(tflops) {
    const entries = Object.entries(tflops || {});
    if (!entries.length) return "";
    const [dtype, value] = entries.reduce((a, b) => (b[1] > a[1] ? b : a));
    return `${value.toPrecision(3)} ${dtype}`;
  }

  async function refresh() {
    const n = await g.getJSON("/api/network");
    const t = n.totals || {};
    g.text("online", `${t.online ?? 0} online`);
    g.text("summary", `${t.workers ?? 0} workers, ${(t.tflops ?? 0).toPrecision(3)} TFLOPS`);
    g.text("read-at", n.read_at ? `read ${g.when(n.read_at)}` : "reading the network…");
    g.facts("totals", [
      ["GPUs", t.gpus ?? 0], ["TFLOPS", (t.tflops ?? 0).toPrecision(3)], ["jobs done", t.jobs_done ?? 0],
      ["queued", t.queued ?? 0],
    ]);
    g.fill("workers", [
      ["worker", w => (w.name ? `${w.name} ` : "") + g.shortId(w.id)],
      ["state", w => w.state + (w.pause_reason ? ` (${w.pause_reason})` : "")],
      ["device", w => w.device.kind === "cuda" ? w.device.name : `CPU ${w.device.cores}c`],
      ["speed", w => best(w.tflops)],
      ["price", w => `${w.price}` + (w.batch_floor !== null && w.batch_floor !== undefined ? ` / batch ${w.batch_floor}` : "")],
      ["reach", w => w.reachability],
      ["queue", w => `${w.queue}/${w.max_concurrent}`],
      ["jobs", w => w.jobs_done],
      ["earned", w => w.ledger.credits_earned.toFixed(6)],
    ], n.workers, "no workers seen yet");
    g.fill("programs", [["program", p => p.hash], ["held by", p => `${p.holders} worker(s)`]], n.programs,
      "no program is held yet");
    g.line("history-online", (n.history || []).map(h => [h.at, h.online]), "workers online", v => `${v} online`);
    g.line("history-tflops", (n.history || []).map(h => [h.at, h.tflops]), "TFLOPS", v => `${v.toPrecision(3)} TFLOPS`);
  }

  g.every(5, refresh);
})();
