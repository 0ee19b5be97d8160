"use strict";
document.addEventListener("DOMContentLoaded", () => {
  for (const form of document.querySelectorAll("form[data-confirm]")) {
    form.addEventListener("submit", (ev) => {
      if (!window.confirm(form.dataset.confirm)) ev.preventDefault();
    });
  }
  const table = document.querySelector("table[data-live]");
  if (table) {
    const rows = document.getElementById("rows");
    const es = new EventSource(table.dataset.live);
    es.addEventListener("rows", (ev) => { rows.innerHTML = ev.data; });
  }
  const events = document.querySelector("ol[data-live]");
  if (events) {
    const es = new EventSource(events.dataset.live);
    es.addEventListener("events", (ev) => { events.insertAdjacentHTML("beforeend", ev.data); });
    es.addEventListener("status", (ev) => {
      const s = document.getElementById("status");
      s.textContent = ev.data;
      s.className = "status status-" + ev.data;
    });
    es.addEventListener("end", () => { es.close(); window.setTimeout(() => location.reload(), 300); });
  }
});
