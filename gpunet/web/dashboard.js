// The worker's dashboard: its /api/status, /api/jobs and /api/earnings, every two seconds; pause and resume.
"use strict";

(() => {
  const g = gpunet;

  async function status() {
    const s = await g.getJSON("/api/status");
    const r = s.record;
    const badge = document.getElementById("state");
    badge.textContent = s.state;
    badge.className = `badge ${s.state}`;
    g.text("reason", s.pause_reason || "");
    g.text("version", r.version);
    g.text("worker-id", s.id);
    // (disabled until the worker answers: a page opened without its key can do nothing)
    document.getElementById("pause").disabled = s.paused_by_hand;
    document.getElementById("pause-reason").disabled = s.paused_by_hand;
    document.getElementById("resume").disabled = !s.paused_by_hand;
    const d = r.device;
    const tflops = Object.entries(r.tflops || {}).map(([k, v]) => `${v.toPrecision(3)} ${k}`).join(", ");
    g.facts("device", [
      ["device", d.kind === "cuda" ? `${d.count > 1 ? d.count + "× " : ""}${d.name}` : `CPU, ${d.cores} cores`],
      ["memory free", `${(d.memory_free / 2 ** 30).toFixed(1)} of ${(d.memory_total / 2 ** 30).toFixed(1)} GiB`],
      ["speed", tflops || "not measured yet"],
    ]);
    g.facts("network", [
      ["reachability", r.reachability],
      ["addresses", (r.maddrs || []).length],
      ["jobs done", r.jobs_done],
      ["uptime", g.duration(s.time - r.started_at)],
    ]);
    const l = s.lanes;
    g.facts("market", [
      ["interactive", `${r.price} credits/TFLOP`],
      ["batch", `${s.batch_floor} now (from ${r.batch_price})`],
      ["running", `${l.interactive.running} interactive, ${l.batch.running} batch, ${l.background.running} own`],
      ["waiting", `${l.interactive.waiting} interactive, ${l.batch.waiting} batch`],
      ["batch stopped", s.preemptions],
    ]);
  }

  async function jobs() {
    const j = await g.getJSON("/api/jobs");
    g.fill("running", [
      ["job", x => x.job_id], ["client", x => g.shortId(x.client_id)], ["lane", x => x.lane],
      ["running for", x => g.duration(x.seconds)], ["price", x => g.credits(x.price)],
    ], j.running, "no job running");
    g.fill("recent", [
      ["ended", x => g.when(x.ended_at)], ["job", x => x.job_id], ["client", x => g.shortId(x.client_id)],
      ["lane", x => x.lane], ["took", x => x.started_at ? g.duration(x.ended_at - x.started_at) : ""],
      ["credits", x => x.amount !== undefined ? g.credits(x.amount) : ""], ["how it ended", x => x.outcome],
    ], j.recent.slice(0, 25), "no jobs yet");
  }

  async function earnings() {
    const e = await g.getJSON("/api/earnings?days=14");
    g.text("earned-total", e.total.credits);
    g.facts("earned", [
      ["jobs paid", e.total.jobs],
      ["counted work", `${e.total.tflop} TFLOP`],
      ["not paid yet", e.unpaid_count],
      ["own background runs", e.background_runs],
      // merged receipts naming this worker that it does not vouch for: never in the figures above (docs/ledger.md)
      ...(e.unvouched && e.unvouched.jobs ? [["merged, not vouched for",
        `${e.unvouched.credits} credits, ${e.unvouched.jobs} jobs (not counted)`]] : []),
    ]);
    const best = e.days.reduce((a, d) => (d.nano > a.nano ? d : a), e.days[0]);
    g.bars("chart", e.days.map(d => ({
      label: d.day.slice(5), value: d.nano, title: `${d.day}: ${d.credits} credits, ${d.jobs} jobs`,
    })), "credits", best && best.nano ? `${best.credits} credits` : "no credits yet");
    g.fill("unpaid", [
      ["delivered", x => g.when(x.delivered_at)], ["job", x => x.job_id], ["client", x => g.shortId(x.client_id)],
      ["credits", x => x.credits], ["why", x => x.reason],
    ], e.unpaid, "everything delivered was paid");
    g.fill("unbilled", [
      ["when", x => g.when(x.at)], ["job", x => x.job_id], ["client", x => g.shortId(x.client_id)],
      ["lane", x => x.lane], ["why", x => x.reason.replace("_", " ")], ["detail", x => x.detail],
    ], e.unbilled, "no work went unbilled");
    g.text("unbilled-more", e.unbilled_count > e.unbilled.length ? `the newest ${e.unbilled.length} of ${e.unbilled_count}` : "");
    g.text("unpaid-more", e.unpaid_count > e.unpaid.length ? `the newest ${e.unpaid.length} of ${e.unpaid_count}` : "");
  }

  document.getElementById("pause").addEventListener("click", async () => {
    await g.postJSON("/api/pause", { reason: document.getElementById("pause-reason").value });
    await status();
  });
  document.getElementById("resume").addEventListener("click", async () => {
    await g.postJSON("/api/resume", {});
    await status();
  });
  g.every(2, () => Promise.all([status(), jobs()]));
  g.every(10, earnings);  // the ledger is the heaviest read: less often
})();
