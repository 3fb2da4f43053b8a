// Sorting and filtering for every table.sortable; no dependencies, nothing fetched.
(function () {
  "use strict";

  function cellValue(row, index, numeric) {
    var cell = row.cells[index];
    if (!cell) return numeric ? null : "";
    var raw = cell.hasAttribute("data-v") ? cell.getAttribute("data-v") : cell.textContent.trim();
    if (!numeric) return raw.toLowerCase();
    if (raw === "") return null;
    var n = parseFloat(raw);
    return isNaN(n) ? null : n;
  }

  function sortTable(table, th) {
    var index = Array.prototype.indexOf.call(th.parentNode.cells, th);
    var numeric = th.getAttribute("data-type") === "num";
    var ascending = th.getAttribute("aria-sort") !== "ascending";
    Array.prototype.forEach.call(th.parentNode.cells, function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.forEach(function (r, i) { r._order = i; });
    rows.sort(function (a, b) {
      var x = cellValue(a, index, numeric), y = cellValue(b, index, numeric);
      // Missing values sort last in both directions.
      if (x === null || x === "") return (y === null || y === "") ? a._order - b._order : 1;
      if (y === null || y === "") return -1;
      var c = x < y ? -1 : x > y ? 1 : 0;
      return (ascending ? c : -c) || a._order - b._order;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  }

  function applyFilter(table) {
    var id = table.id;
    var text = document.querySelector('input.filter[data-table="' + id + '"]');
    var status = document.querySelector('select.status-filter[data-table="' + id + '"]');
    var count = document.querySelector('.count[data-table="' + id + '"]');
    var needle = text ? text.value.trim().toLowerCase() : "";
    var want = status ? status.value : "";
    var shown = 0, rows = table.tBodies[0].rows;
    for (var i = 0; i < rows.length; i++) {
      var row = rows[i];
      var ok = (!needle || row.textContent.toLowerCase().indexOf(needle) >= 0) &&
               (!want || (want === "fail" ? row.getAttribute("data-status") !== "pass"
                                           : row.getAttribute("data-status") === want));
      row.hidden = !ok;
      if (ok) shown++;
    }
    if (count) count.textContent = shown + " of " + rows.length + " rows";
  }

  document.querySelectorAll("table.sortable").forEach(function (table) {
    table.tHead.rows[0].querySelectorAll("th").forEach(function (th) {
      th.setAttribute("title", "click to sort");
      th.addEventListener("click", function () { sortTable(table, th); });
    });
    applyFilter(table);
  });
  document.querySelectorAll("input.filter, select.status-filter").forEach(function (control) {
    var table = document.getElementById(control.getAttribute("data-table"));
    if (!table) return;
    control.addEventListener(control.tagName === "SELECT" ? "change" : "input", function () { applyFilter(table); });
  });
})();
