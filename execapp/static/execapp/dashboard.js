// The live pool dashboard (templates/execapp/dashboard.html): polls the staff-only data endpoint
// and draws it with DOM nodes and textContent only. A file of its own, not an inline script: the
// Content-Security-Policy (execapp/security_headers.py) runs scripts from this site's files only.
(function () {
  "use strict";
  var root = document.getElementById("dash");
  var DATA_URL = root.getAttribute("data-url");
  var PALETTE = ["#1565c0", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#558b2f", "#4e342e", "#283593"];
  var TOTAL = "#263238";
  var pollMs = 2000;

  function $(id) { return document.getElementById(id); }
  function num(v, digits) {
    if (v === null || v === undefined || isNaN(v)) return "-";
    return Number(v).toLocaleString(undefined, {maximumFractionDigits: digits === undefined ? 0 : digits});
  }
  function ms(v) { return v === null || v === undefined ? "-" : num(v * 1000, v * 1000 < 10 ? 2 : 1); }
  function pct(v) { return v === null || v === undefined ? "-" : num(v * 100, 1) + "%"; }
  function when(ts) { return ts ? new Date(ts * 1000).toLocaleTimeString() : "-"; }
  function cell(tr, text, cls, title) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    if (title) td.title = title;
    tr.appendChild(td);
    return td;
  }
  function tag(td, text, kind) {
    var s = document.createElement("span");
    s.className = "tag " + (kind || "");
    s.textContent = text;
    td.appendChild(s);
  }
  function satBar(td, sat) {
    var b = document.createElement("span"); b.className = "satbar";
    var i = document.createElement("i");
    i.style.width = Math.min(100, Math.round((sat || 0) * 100)) + "%";
    i.style.background = sat > 0.8 ? "var(--bad)" : (sat > 0.5 ? "var(--warn)" : "var(--ok)");
    b.appendChild(i); td.appendChild(b);
    td.appendChild(document.createTextNode(pct(sat)));
  }
  function fill(tbody, rows, empty, cols) {
    while (tbody.firstChild) tbody.removeChild(tbody.firstChild);
    if (!rows.length) {
      var tr = document.createElement("tr"), td = cell(tr, empty, "empty");
      td.colSpan = cols; tbody.appendChild(tr);
    }
    rows.forEach(function (tr) { tbody.appendChild(tr); });
  }

  function refusalText(refusals) {
    var keys = Object.keys(refusals || {}).sort();
    return keys.length ? keys.map(function (k) { return k + ": " + num(refusals[k]); }).join(", ") : "none";
  }

  function poolRow(name, slot, status, p, counts, eps, refused, refusals, age, cls) {
    var tr = document.createElement("tr");
    if (cls) tr.className = cls;
    cell(tr, slot === null ? name : name + " (" + slot + ")", "id", name);
    var st = cell(tr, "");
    status.forEach(function (s) { tag(st, s[0], s[1]); st.appendChild(document.createTextNode(" ")); });
    var room = (p.capacity || 0) + (p.queue_capacity || 0);
    var sat = p.saturation !== undefined ? p.saturation : (room ? ((p.in_flight || 0) + (p.queued || 0)) / room : 0);
    cell(tr, num(p.in_flight) + " / " + num(p.capacity), "n");
    cell(tr, num(p.queued) + " / " + num(p.queue_capacity), "n");
    satBar(cell(tr, ""), sat);
    cell(tr, num(p.submitted), "n");
    cell(tr, num(counts.fallbacks), "n");
    cell(tr, num(refused || 0), refused ? "n refused" : "n", refusalText(refusals));
    cell(tr, num(p.failed), "n");
    cell(tr, num(p.stuck || 0), p.stuck ? "n stuck" : "n");
    cell(tr, ms(p.delay_p50) + " / " + ms(p.delay_p99), "n");
    cell(tr, num(eps, 1), "n");
    cell(tr, num(counts.events), "n");
    cell(tr, age === null ? "" : num(age, 1), "n");
    return tr;
  }

  function renderWorkers(d) {
    var rows = d.workers.map(function (w) {
      var status = [];
      if (w.gone) status.push(["process gone", "bad"]);
      else if (w.stopped) status.push(["stopped", "bad"]);
      else if (w.stale) status.push(["stale", "bad"]);
      else status.push(["live", "ok"]);
      if (w.draining) status.push(["draining", "warn"]);
      if (w.recycling) status.push(["recycling", "warn"]);
      // The worker's delay is the one its chart plots: the last closed interval's.
      var p = Object.assign({}, w.pool || {}, {delay_p50: w.interval_delay_p50, delay_p99: w.interval_delay_p99});
      var tr = poolRow(w.worker, w.slot === undefined ? null : w.slot, status, p, w.counts || {},
                       w.events_per_second, w.refused, w.refusals, w.age, (w.stale || w.stopped) ? "stale" : null);
      tr.setAttribute("data-worker", w.worker);
      return tr;
    });
    var t = d.total;
    var total = poolRow("Total (" + t.workers + " live)", null, [], t, t, t.events_per_second, t.refused, t.refusals,
                        null, "total");
    total.id = "workers-total";
    if (d.workers.length) rows.push(total);
    fill(document.querySelector("#workers-table tbody"), rows, "no worker has published a snapshot yet", 14);
  }

  function renderMatchers(d) {
    var eventsUrl = root.getAttribute("data-events-url");
    var rows = d.matchers.map(function (m) {
      var tr = document.createElement("tr");
      tr.setAttribute("data-matcher", m.matcher);
      cell(tr, m.matcher, "id", m.kind + " " + m.pattern);
      cell(tr, m.plugin || "-");
      tag(cell(tr, ""), m.exec_class, m.exec_class === "sync" ? "ok" : "warn");
      var state = cell(tr, m.state + " ");
      if (m.quarantined) { tag(state, "quarantined", "bad"); state.title = m.quarantined; }
      else if (m.pool_only) { tag(state, "pool only", "warn"); state.title = m.pool_only; }
      cell(tr, ms(m.p50), "n");
      cell(tr, ms(m.p99), "n");
      cell(tr, num(m.runs), "n");
      cell(tr, num(m.errors), "n");
      cell(tr, num(m.timeouts), "n");
      cell(tr, num(m.refused || 0), m.refused ? "n refused" : "n", refusalText(m.failures));
      cell(tr, num(m.promotions) + " / " + num(m.demotions), "n");
      var promotedLast = (m.promoted_at || 0) >= (m.demoted_at || 0);
      var changed = promotedLast ? m.promoted_at : m.demoted_at;
      cell(tr, changed ? (promotedLast ? "promoted " : "demoted ") + when(changed) : "-", "n",
           "last promotion " + when(m.promoted_at) + ", last demotion " + when(m.demoted_at));
      var err = cell(tr, "", "err", m.last_error || "");
      if (m.last_failure && m.last_failure.uid && eventsUrl) {
        var a = document.createElement("a");
        a.href = eventsUrl + encodeURIComponent(m.last_failure.uid) + "/change/";
        a.textContent = m.last_error;
        a.title = m.last_error + " (event " + m.last_failure.event_id + ", " + when(m.last_failure.ts) + ")";
        err.appendChild(a);
      } else {
        err.textContent = m.last_error || "";
      }
      return tr;
    });
    fill(document.querySelector("#matchers-table tbody"), rows, "no matcher registered", 13);
  }

  function renderPlugins(d) {
    var rows = d.plugin_pools.map(function (p) {
      var tr = document.createElement("tr");
      cell(tr, p.plugin); cell(tr, p.runtime || "-"); cell(tr, p.strategy || "-"); cell(tr, p.worker, "id", p.worker);
      [p.capacity, p.busy, p.idle, p.waiting, p.waits_total, p.timeouts_total, p.errors_total].forEach(function (v) {
        cell(tr, num(v), "n");
      });
      cell(tr, num(p.refused || 0), p.refused ? "n refused" : "n");
      return tr;
    });
    fill(document.querySelector("#plugin-pools-table tbody"), rows, "no plugin instance pool reported", 12);
  }

  function renderCards(d) {
    var t = d.total;
    $("card-saturation").textContent = pct(t.saturation);
    $("card-running").textContent = num(t.in_flight) + " / " + num(t.capacity);
    $("card-queued").textContent = num(t.queued) + " / " + num(t.queue_capacity);
    $("card-eps").textContent = num(t.events_per_second, 1);
    $("card-submitted").textContent = num(t.submitted);
    $("card-fallbacks").textContent = num(t.fallbacks) + " / " + num(t.overloaded);
    $("card-refused").textContent = num(t.refused || 0);
    $("card-refused-box").title = refusalText(t.refusals) + (t.session_frames_dropped ?
      "; session frames dropped for members that fell behind (each then got a lagged frame): " +
      num(t.session_frames_dropped) : "");
    $("card-refused").style.color = t.refused > 0 ? "var(--warn)" : "";
    $("card-delay").textContent = ms(t.delay_p50) + " / " + ms(t.delay_p99);
    $("card-stuck").textContent = num(t.stuck || 0) + " / " + num(t.stuck_total || 0);
    $("card-stuck").style.color = t.stuck > 0 ? "var(--bad)" : "";
    $("card-saturation").style.color = t.saturation > 0.8 ? "var(--bad)" : (t.saturation > 0.5 ? "var(--warn)" : "");
    $("rate-window").textContent = $("rate-window-2").textContent = num(d.rate_window_seconds || 10);
  }

  // -- charts: inline SVG, x = seconds before the server's "now" -------------------------------
  var SVGNS = "http://www.w3.org/2000/svg";
  function svgEl(name, attrs, text) {
    var e = document.createElementNS(SVGNS, name);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function niceMax(v) {
    if (!(v > 0)) return 1;
    var p = Math.pow(10, Math.floor(Math.log10(v))), m = v / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }
  function chart(id, lines, now, span, fixedMax, unit) {
    var svg = $(id), W = 600, H = 170, L = 42, R = 6, T = 8, B = 18;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var maxV = 0;
    lines.forEach(function (l) { l.points.forEach(function (p) { if (p[1] !== null && p[1] > maxV) maxV = p[1]; }); });
    var yMax = fixedMax || niceMax(maxV * 1.1);
    function x(t) { return L + (W - L - R) * (1 - (now - t) / span); }
    function y(v) { return T + (H - T - B) * (1 - Math.min(v, yMax) / yMax); }
    for (var i = 0; i <= 4; i++) {
      var v = yMax * i / 4;
      svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: y(v), y2: y(v), "class": "grid"}));
      svg.appendChild(svgEl("text", {x: L - 4, y: y(v) + 3, "text-anchor": "end", "class": "axis"},
                            num(v, v < 10 ? 1 : 0) + (unit || "")));
    }
    [span, span / 2, 0].forEach(function (s) {
      svg.appendChild(svgEl("text", {x: x(now - s), y: H - 4, "text-anchor": s === span ? "start" : (s ? "middle" : "end"),
                                     "class": "axis"}, s ? "-" + Math.round(s) + "s" : "now"));
    });
    lines.forEach(function (l) {
      var d = "", pen = false;
      l.points.forEach(function (p) {
        if (p[1] === null || now - p[0] > span) { pen = false; return; }
        d += (pen ? "L" : "M") + x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1);
        pen = true;
      });
      if (d) svg.appendChild(svgEl("path", {d: d, stroke: l.color, "class": "line " + (l.cls || "")}));
    });
    var legend = $(id.replace("chart-", "legend-"));
    while (legend.firstChild) legend.removeChild(legend.firstChild);
    lines.forEach(function (l) {
      var s = document.createElement("span"), i = document.createElement("i");
      i.style.background = l.color; s.appendChild(i); s.appendChild(document.createTextNode(l.name));
      legend.appendChild(s);
    });
  }

  function renderCharts(d) {
    var F = {}; d.series_fields.forEach(function (f, i) { F[f] = i; });
    function sat(p) { var room = p[F.capacity] + p[F.queue_capacity]; return room ? 100 * (p[F.in_flight] + p[F.queued]) / room : 0; }
    function pick(series, fn) { return series.map(function (p) { return [p[F.t], fn(p)]; }); }
    var total = d.total.series, live = d.workers.filter(function (w) { return !w.stale && !w.stopped; });
    var oldest = d.now;
    total.forEach(function (p) { if (p[F.t] < oldest) oldest = p[F.t]; });
    var span = Math.max(60, Math.min(d.now - oldest, 300));
    $("span").textContent = Math.round(span) + " s";
    var perWorker = function (fn) {
      return live.length > 1 ? live.map(function (w, i) {
        return {name: w.worker, color: PALETTE[i % PALETTE.length], points: pick(w.series, fn)};
      }) : [];
    };
    // Scaled to the data (a 2-4% load is not a flat line), never past 100%.
    var satLines = [{name: "all workers", color: TOTAL, cls: "total", points: pick(total, sat)}].concat(perWorker(sat));
    var satMax = 0;
    satLines.forEach(function (l) { l.points.forEach(function (p) { if (p[1] > satMax) satMax = p[1]; }); });
    chart("chart-saturation", satLines, d.now, span, Math.min(100, niceMax(satMax * 1.1)), "%");
    chart("chart-load", [
      {name: "running", color: PALETTE[0], cls: "total", points: pick(total, function (p) { return p[F.in_flight]; })},
      {name: "queued", color: PALETTE[1], cls: "total", points: pick(total, function (p) { return p[F.queued]; })},
      {name: "capacity", color: TOTAL, cls: "ref", points: pick(total, function (p) { return p[F.capacity]; })}
    ], d.now, span);
    chart("chart-delay", [
      {name: "p50", color: PALETTE[0], cls: "total", points: pick(total, function (p) { return p[F.delay_p50] === null ? null : p[F.delay_p50] * 1000; })},
      {name: "p99", color: PALETTE[4], cls: "total", points: pick(total, function (p) { return p[F.delay_p99] === null ? null : p[F.delay_p99] * 1000; })}
    ], d.now, span);
    var eps = function (p) { return p[F.events_per_second]; };
    chart("chart-eps", [{name: "all workers", color: TOTAL, cls: "total", points: pick(total, eps)}].concat(perWorker(eps)),
          d.now, span);
    // The headers show the snapshot the cards show (the charts' last point is that snapshot too).
    var t = d.total;
    $("now-saturation").textContent = pct(t.saturation);
    $("now-load").textContent = num(t.in_flight) + " running, " + num(t.queued) + " queued";
    $("now-delay").textContent = t.delay_p99 !== null && t.delay_p99 !== undefined ? "p99 " + ms(t.delay_p99) + " ms" : "";
    $("now-eps").textContent = num(t.events_per_second, 1) + "/s";
  }

  // The event history's recent store: what it keeps, and whether traces were evicted to stay
  // within EXECAPP['HISTORY_MAX_EVENTS'] or its byte bound (then the Events page misses them).
  function historyText(h) {
    if (!h) return "unreadable";
    var text = h.traces + " kept (" + (h.bytes / 1048576).toFixed(1) + " of " + (h.max_bytes / 1048576).toFixed(0) + " MiB)";
    if (h.by_bytes) text += ", " + h.by_bytes + " evicted over the byte bound (last " +
      new Date(h.by_bytes_ts * 1000).toLocaleTimeString() + ")";
    if (h.by_count) text += ", " + h.by_count + " evicted over " + h.max_events + " traces";
    return text;
  }

  function render(d) {
    window.__dash = d;  // the data of the frame on screen (tests and curious operators)
    $("backend").textContent = d.backend;
    $("worker-count").textContent = d.workers.filter(function (w) { return !w.stale && !w.stopped; }).length +
      " live" + (d.workers.length ? " of " + d.workers.length : "");
    $("history").textContent = historyText(d.history);
    renderCards(d); renderWorkers(d); renderMatchers(d); renderPlugins(d); renderCharts(d);
    pollMs = Math.min(2000, Math.max(500, (d.poll_seconds || 2) * 1000));
  }

  function refresh() {
    fetch(DATA_URL, {credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (r) {
        // Refused (429: this user asks too often; 503: the worker answers enough already): wait
        // what the server asks before the next poll.
        var retry = Number(r.headers.get("Retry-After"));
        if (retry > 0) pollMs = Math.max(pollMs, retry * 1000);
        if (r.status !== 200) throw new Error("HTTP " + r.status + (r.redirected ? " (logged out?)" : ""));
        return r.json();
      })
      .then(function (d) {
        render(d);
        // A partial answer (its backend unreachable) says what is missing instead of looking live.
        $("status").textContent = d.warning ? "partial, " + new Date().toLocaleTimeString() + ": " + d.warning
                                            : "live, updated " + new Date().toLocaleTimeString();
        $("live-dot").className = d.warning ? "live-dot off" : "live-dot on";
        root.setAttribute("data-updates", String(Number(root.getAttribute("data-updates") || 0) + 1));
      })
      .catch(function (e) {
        $("status").textContent = "no data: " + e.message;
        $("live-dot").className = "live-dot off";
      })
      .then(function () { setTimeout(refresh, pollMs); });
  }
  refresh();
})();
