// The console's only script: the record page's binding-table search. Without it the table is simply complete.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  const search = document.getElementById("binding-search");
  const table = document.querySelector("table.binding");
  if (!search || !table) return;
  search.hidden = false;
  search.addEventListener("input", () => {
    const needle = search.value.trim().toLowerCase();
    for (const row of table.tBodies[0].rows) {
      row.hidden = needle !== "" && !row.textContent.toLowerCase().includes(needle);
    }
  });
});
