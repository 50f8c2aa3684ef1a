// The console's charts, drawn by Chart.js from data the page or /api/kv gives.
"use strict";
(function () {
  const fmtBytes = (n) => {
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + u[i];
  };
  const done = () => { document.body.dataset.chartsReady = "1"; };
  const pending = [];

  // collection page: bytes written against bytes shared, per version (oldest first)
  const bytes = document.getElementById("bytes-chart");
  if (bytes) {
    const versions = JSON.parse(bytes.dataset.versions).reverse();
    const written = JSON.parse(bytes.dataset.written).reverse();
    const shared = JSON.parse(bytes.dataset.shared).reverse();
    new Chart(bytes, {
      type: "bar",
      data: { labels: versions.map((v) => "v" + v), datasets: [
        { label: "bytes written", data: written, backgroundColor: "#2f6fde" },
        { label: "bytes shared with earlier versions", data: shared, backgroundColor: "#a9c4f5" } ] },
      options: { animation: false, maintainAspectRatio: false,
        scales: { x: { stacked: true }, y: { stacked: true, ticks: { callback: fmtBytes } } },
        plugins: { tooltip: { callbacks: { label: (c) => c.dataset.label + ": " + fmtBytes(c.raw) } } } },
    });
  }

  // KV page: each namespace's hit rate and occupancy over time
  const byName = {};
  document.querySelectorAll("canvas.kv-chart").forEach((c) => {
    (byName[c.dataset.namespace] = byName[c.dataset.namespace] || []).push(c);
  });
  // UTC, as the pages' times are
  const timeLabel = (t) => new Date(t * 1000).toLocaleTimeString([], { hourCycle: "h23", timeZone: "UTC" });
  for (const [name, canvases] of Object.entries(byName)) {
    pending.push(fetch("/api/kv?name=" + encodeURIComponent(name), { credentials: "same-origin" })
      .then((r) => r.json())
      .then((s) => {
        for (const c of canvases) {
          const kind = c.dataset.kind;
          const label = kind === "hit_rate" ? "hit rate per " + s.interval + " s" : "occupancy of the arena";
          c.dataset.points = String(s.t.length);
          new Chart(c, {
            type: "line",
            data: { labels: s.t.map(timeLabel), datasets: [{ label: label, data: s[kind],
              borderColor: kind === "hit_rate" ? "#2e8b57" : "#2f6fde", spanGaps: true,
              pointRadius: 2, tension: 0.2, fill: false }] },
            options: { animation: false, maintainAspectRatio: false,
              scales: { x: { ticks: { maxTicksLimit: 8, maxRotation: 0 }, title: { display: true, text: "UTC" } },
                        y: { min: 0, max: 1, ticks: { callback: (v) => Math.round(v * 100) + " %" } } } },
          });
        }
      }));
  }
  Promise.allSettled(pending).then(done);
})();
