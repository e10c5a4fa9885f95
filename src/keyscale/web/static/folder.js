// The folder page: every job under the folder, refreshed every 5 s; "open" goes through the
// folder server, which asks the running job for a one-time dashboard link.
"use strict";

async function refresh() {
  const r = await fetch("/jobs", { credentials: "same-origin" });
  const data = await r.json();
  document.getElementById("folder").textContent = data.folder;
  document.querySelector("#jobs tbody").replaceChildren(...data.jobs.map((j) => {
    const tr = document.createElement("tr");
    tr.dataset.job = j.job;
    const par = Object.entries(j.parallelism || {}).map(([u, p]) => `${u}=${p}`).join(", ");
    const cells = [j.job, j.state + (j.error ? `: ${j.error}` : ""), j.last_checkpoint ?? "–", par || "–", j.dir];
    for (const c of cells) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
    const td = document.createElement("td");
    if (j.state === "running") {
      const a = document.createElement("a");
      a.href = `/open?dir=${encodeURIComponent(j.dir)}`;
      a.textContent = "open";
      td.appendChild(a);
    }
    tr.appendChild(td);
    return tr;
  }));
  document.body.dataset.loaded = "true";
}

refresh();
setInterval(refresh, 5000);
