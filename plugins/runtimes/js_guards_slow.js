"use strict";
// The guards' slow paths (plugins/runtimes/js_guards.js): the body of a function compiled in a
// Context the first time one of them is needed (few Contexts ever need one, and every byte of
// the prelude is read and run in each new Context). `c` holds the intrinsics the prelude
// captured before any guest code ran; it returns the implementations.
const {apply, reflectGet, defineProp, isArray, toObject, trunc, NativeProxy, rxReplace, sIndexOf, sLastIndexOf,
       sSlice, spreadable, text, toLength, genuine, SEARCH_MAX, MAX_LENGTH, tooLong, reflectSet, ownKeys,
       getOwnDescriptor, ITERATOR, TA, numValueOf, strValueOf, parse, sCharCodeAt, SORT_RUN, arrayFill, JOIN_RUN,
       arraySlice, AP, NativeArray, speciesGet, hasOwn, getProto, SPECIES, nativeExec} = c;
// Whether the native slice of the genuine array `a` makes a plain Array (ArraySpeciesCreate finds
// Array.prototype.constructor, as data, the native Array, whose species getter is the native's).
const plainSpecies = (a) => {
  if (getProto(a) !== AP || getOwnDescriptor(a, "constructor") !== undefined) return false;
  const d = getOwnDescriptor(AP, "constructor"), sd = getOwnDescriptor(NativeArray, SPECIES);
  return d !== undefined && hasOwn(d, "value") && d.value === NativeArray && sd !== undefined && sd.get === speciesGet;
};
// A genuine array of n elements, each an own data property (0): writing one then meets no setter.
const filled = (n) => { const a = []; a.length = n; return apply(arrayFill, a, [0]); };
// (The native's test for [[NumberData]] or [[StringData]]: its own valueOf throws on anything else.)
const boxed = (valueOf, v) => { try { apply(valueOf, v, []); return true; } catch (_) { return false; } };
const REPLACER_MAX = 1 << 26, COLLIDING = 128, OWN_KEYS_MAX = 1 << 26, CAPTURES_MAX = 65535;
const FIELDS = ["enumerable", "configurable", "value", "writable", "get", "set"];
// CreateDataProperty: a plain `a[i] = v` would call a setter the guest put on Array.prototype.
const put = (a, k, v) => {
  if (!defineProp(a, k, {value: v, writable: true, enumerable: true, configurable: true}))
    throw new TypeError("cannot define element " + k);
};
const flatten = (target, source, len, start, depth, mapper, thisArg) => {
  let t = start;
  for (let i = 0; i < len; i++) {
    if (!(i in source)) continue;
    let e = source[i];
    if (mapper !== undefined) e = apply(mapper, thisArg, [e, i, source]);
    if (depth > 0 && isArray(e)) t = flatten(target, e, toLength(e.length), t, depth - 1);
    else put(target, t++, e);
  }
  return t;
};
// Start positions per slice: each of them costs at most needle.length comparisons.
const width = (needle) => needle.length < SEARCH_MAX ? trunc(SEARCH_MAX / needle.length) : 1;
// The index of the first `needle` in `s` at or after `from`, or -1: natively on slices of `s`
// of at most SEARCH_MAX comparisons each, from this (polled) loop. The slices start small and
// double, so that a search whose match is near (split and replaceAll call it once per match)
// copies little.
const finder = (s, needle) => {
  const m = needle.length, w = width(needle);
  return (from) => {
    for (let i = from, step = w < 64 ? w : 64; i + m <= s.length; i += step, step = step * 2 < w ? step * 2 : w) {
      const j = apply(sIndexOf, apply(sSlice, s, [i, i + step + m - 1]), [needle]);
      if (j !== -1) return i + j;
    }
    return -1;
  };
};
// ToIntegerOrInfinity (a BigInt or a Symbol throws its TypeError, as in the natives).
const integer = (v) => { const p = +v; return p !== p ? 0 : trunc(p); };
const start = (pos, len) => {
  let p = +pos;
  p = p !== p ? 0 : trunc(p);
  return p < 0 ? 0 : p > len ? len : p;
};
const DOLLAR = /\$([$&`'])/g;
// Its own exec and flags: the native replace reads both from the regexp, and RegExp.prototype's are the
// guest's by then (a guest exec whose result had a length of 2,000 on a 30,000-deep chain had its
// captures read in C, unpolled: 3.1 s on a 0.3 s budget; 200,000 ran past 60 s).
defineProp(DOLLAR, "exec", {value: nativeExec});
defineProp(DOLLAR, "flags", {value: "g"});
// GetSubstitution without captures: $$, $&, $` and $' (any other $ stays as it is).
const substitute = (repl, matched, at, s) => apply(sIndexOf, repl, ["$"]) < 0 ? repl :
  apply(rxReplace, DOLLAR, [repl, (_, ch) => ch === "$" ? "$" : ch === "&" ? matched :
    ch === "`" ? apply(sSlice, s, [0, at]) : apply(sSlice, s, [at + matched.length])]);
const replacement = (fn, repl, matched, at, s) => fn ? text(repl(matched, at, s)) : substitute(repl, matched, at, s);
// Typed arrays past TA.CHUNK elements (js_guards.js): the natives on views of at most TA.CHUNK
// elements each, made with the native constructor of the array's own kind (never its species).
const taKind = (ta) => TA.kinds[apply(TA.tag, ta, [])];
const view = (ta, i, j) => {
  const N = taKind(ta);
  return new N(apply(TA.buffer, ta, []), apply(TA.offset, ta, []) + i * N.BYTES_PER_ELEMENT, j - i);
};
const chunks = (n, f) => { for (let i = 0; i < n; i += TA.CHUNK) f(i, i + TA.CHUNK < n ? i + TA.CHUNK : n); };
const taSet = (target, src, offset) => {
  const tn = apply(TA.length, target, []);  // (a TypeError if target is no typed array)
  let o = +offset;
  o = o !== o ? 0 : trunc(o);
  const n = apply(TA.length, src, []);
  // What the native refuses (a negative offset or one past the end, a detached array) it refuses
  // before any work: let it say so.
  if (o < 0 || o + n > tn) return apply(TA.set, target, [src, o]);
  // One buffer: the native moves memory as a whole between arrays of one kind (copied first here,
  // chunks in order could overwrite what a later one reads) and converts element by element, in
  // order, between kinds (so do these chunks, in order).
  if (apply(TA.buffer, target, []) === apply(TA.buffer, src, []) && taKind(target) === taKind(src)) {
    const copy = new (taKind(src))(n);
    chunks(n, (i, j) => apply(TA.set, view(copy, i, j), [view(src, i, j)]));
    src = copy;
  }
  chunks(n, (i, j) => apply(TA.set, view(target, o + i, o + j), [view(src, i, j)]));
};
// Integer kinds of 8 and 16 bits are counted instead, in place: merging needs a scratch array as
// long as the original, which a 14 MB Uint8Array at the default 16 MiB cap does not leave room for.
// (Each kind's lowest value and its number of values.)
const COUNTED = {__proto__: null, Int8Array: [-128, 256], Uint8Array: [0, 256], Uint8ClampedArray: [0, 256],
                 Int16Array: [-32768, 65536], Uint16Array: [0, 65536]};
// Natively, in chunks: from[i, j) into to[at + i - from_i...) (tails of merged runs, the result).
const copy = (to, at, from, i, j) => chunks(j - i, (a, b) => apply(TA.set, view(to, at + a, at + b),
                                                                   [view(from, i + a, i + b)]));
const taSort = (ta) => {
  const n = apply(TA.length, ta, []), counted = COUNTED[apply(TA.tag, ta, [])];
  if (counted !== undefined) {
    const low = counted[0], src = view(ta, 0, n), counts = new TA.kinds.Uint32Array(counted[1]);
    if (counted[1] === 256) {
      // 8 bits: each chunk sorted natively, then each run of one value measured by a binary
      // search (at most 256 per chunk): ~2x faster than counting element by element in bytecode.
      chunks(n, (i, j) => {
        apply(TA.sort, view(ta, i, j), []);
        for (let p = i; p < j;) {
          const v = src[p];
          let lo = p + 1, hi = j;
          while (lo < hi) { const m = (lo + hi) >>> 1; if (src[m] === v) lo = m + 1; else hi = m; }
          counts[v - low] += lo - p;
          p = lo;
        }
      });
    } else {
      for (let i = 0; i < n; i++) counts[src[i] - low]++;
    }
    for (let v = 0, k = 0; v < counts.length; k += counts[v++])
      if (counts[v]) chunks(counts[v], (i, j) => apply(TA.fill, view(ta, k + i, k + j), [v + low]));
    return ta;
  }
  chunks(n, (i, j) => apply(TA.sort, view(ta, i, j), []));
  // Then runs of TA.CHUNK, 2 x TA.CHUNK... merged in bytecode between ta and a scratch array, in
  // the default order: ascending, -0 before +0, NaN last (a BigInt 0n is never === 0).
  let src = view(ta, 0, n), dst = new (taKind(ta))(n), flipped = false;
  for (let w = TA.CHUNK; w < n; w *= 2, flipped = !flipped) {
    for (let lo = 0; lo < n; lo += 2 * w) {
      const mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
      let i = lo, j = mid, k = lo, a = src[i], b = src[j];
      while (i < mid && j < hi) {
        if (a < b || b !== b || (a === b && (a !== 0 || 1 / a < 0 || 1 / b > 0))) { dst[k++] = a; a = src[++i]; }
        else { dst[k++] = b; b = src[++j]; }
      }
      copy(dst, k, src, i, mid);
      copy(dst, k + mid - i, src, j, hi);
    }
    const t = src; src = dst; dst = t;
  }
  if (flipped) copy(ta, 0, src, 0, n);
  return ta;
};
// (character codes: 48..57 the digits, 36 '$', 38 '&', 96 '`', 39 "'", 60 '<')
const digit = (c) => c >= 48 && c <= 57;
return {
  // A replacement string as the function that makes what the native's GetSubstitution makes of it
  // at each match (QuickJS's steps: `$nn` only when nn names a capture, else `$n`; a `$<` only when
  // captures are named, read by name from ToObject(groups)). Called as the native calls a function
  // replacement: (matched, captures..., position, string[, groups]), where position is a number and
  // a capture a string or undefined, so groups were passed when the second-last is not a number.
  // Each match walks the replacement's `$`s in bytecode; each `>` is searched for once.
  template(rep) {
    const len = rep.length;
    return function (matched) {
      const n = arguments.length, named = typeof arguments[n - 2] !== "number", count = named ? n - 3 : n - 2;
      const position = arguments[count], s = arguments[count + 1];
      const groups = named ? toObject(arguments[n - 1]) : undefined;
      let out = "", i = 0, gt = -2;
      for (;;) {
        let j = apply(sIndexOf, rep, ["$", i]);
        if (j < 0 || j + 1 >= len) break;
        out += apply(sSlice, rep, [i, j]);
        const j0 = j++, c = apply(sCharCodeAt, rep, [j++]);
        if (c === 36) out += "$";
        else if (c === 38) out += matched;
        else if (c === 96) out += apply(sSlice, s, [0, position]);
        else if (c === 39) out += apply(sSlice, s, [position + matched.length]);
        else if (digit(c)) {
          let k = c - 48;
          if (j < len) {
            const c1 = apply(sCharCodeAt, rep, [j]), k1 = k * 10 + c1 - 48;
            if (digit(c1) && k1 >= 1 && k1 < count) { k = k1; j++; }
          }
          if (k >= 1 && k < count) { const v = arguments[k]; if (v !== undefined) out += text(v); }
          else out += apply(sSlice, rep, [j0, j]);
        } else if (c === 60 && named) {
          if (gt !== -1 && gt < j) gt = apply(sIndexOf, rep, [">", j]);
          if (gt < 0) {
            out += apply(sSlice, rep, [j0, j]);
          } else {
            const v = groups[apply(sSlice, rep, [j, gt])];
            if (v !== undefined) out += text(v);
            j = gt + 1;
          }
        } else {
          out += apply(sSlice, rep, [j0, j]);
        }
        i = j;
      }
      return out + apply(sSlice, rep, [i]);
    };
  },
  // What the RegExp constructor compiles of an object that is not a regexp (js_guards.js): [P, F],
  // the pattern's text and the flags, read as the native reads them (IsRegExp, then its source and
  // flags, or the object itself), the pattern made a string.
  pattern(p, flags, isRegExp) {
    let f = flags;
    if (isRegExp(p)) {
      const source = p.source;
      if (f === undefined) f = p.flags;
      p = source;
    }
    return [p === undefined ? "" : text(p), f];
  },
  taSet,
  taSort,
  taToSorted(ta) {
    const n = apply(TA.length, ta, []), c = new (taKind(ta))(n);
    copy(c, 0, ta, 0, n);
    return taSort(c);
  },
  taCopy(N, src, newTarget) {  // new N(src) for a typed array src past TA.CHUNK elements
    const t = TA.construct(N, [apply(TA.length, src, [])], newTarget);
    taSet(t, src, 0);
    return t;
  },
  taJoin(ta, sep) {
    let out = "";
    chunks(apply(TA.length, ta, []), (i, j) => {
      const part = apply(TA.join, view(ta, i, j), [sep]);
      out = i ? out + sep + part : part;
    });
    return out;
  },
  // The native on a receiver that is neither a genuine array nor a string: its length read once,
  // and a view that reports that value to the native (which reads it again).
  view(native, self, args, name) {
    const o = toObject(self), n = toLength(o.length);
    if (n > MAX_LENGTH) throw tooLong("Array.prototype." + name, n);
    // Every read, presence check and write goes through a trap (a polled call): each may walk a
    // long prototype chain in C, once.
    const v = new NativeProxy(o, {get: (t, k) => k === "length" ? n : reflectGet(t, k, t), has: (t, k) => k in t,
                                  set: (t, k, value) => reflectSet(t, k, value, t)});
    const r = apply(native, v, args);
    return r === v ? o : r;
  },
  concat(o, items) {
    const a = [];
    let n = 0;
    for (let j = -1; j < items.length; j++) {
      const e = j < 0 ? o : items[j];
      let spread = false;
      if (e !== null && (typeof e === "object" || typeof e === "function")) {
        const s = e[spreadable];
        spread = s !== undefined ? !!s : isArray(e);
      }
      if (!spread) { put(a, n++, e); continue; }
      const len = toLength(e.length);
      if (n + len > 2 ** 53 - 1) throw new TypeError("concat: the result would be too long");
      for (let k = 0; k < len; k++, n++) if (k in e) put(a, n, e[k]);
    }
    a.length = n;
    return a;
  },
  flat(o, depth, mapper, thisArg) {
    const a = [];
    flatten(a, o, toLength(o.length), 0, depth, mapper, thisArg);
    return a;
  },
  // Array.prototype.indexOf, lastIndexOf or includes of the string `v` on the genuine array `a`,
  // with the natives' steps (fromIndex read once, after the length; holes skipped by indexOf and
  // lastIndexOf, read as undefined by includes), one polled comparison per element.
  search(name, a, v, args) {
    const len = a.length;
    if (name === "lastIndexOf") {
      const n = args.length > 1 ? integer(args[1]) : len - 1;
      for (let k = n >= 0 ? (n < len - 1 ? n : len - 1) : len + n; k >= 0; k--) if (k in a && a[k] === v) return k;
      return -1;
    }
    const n = integer(args.length > 1 ? args[1] : undefined), includes = name === "includes";
    for (let k = n >= 0 ? n : (len + n > 0 ? len + n : 0); k < len; k++) {
      if (includes ? a[k] === v : k in a && a[k] === v) return includes ? true : k;
    }
    return includes ? false : -1;
  },
  indexOf: (s, n, pos) => finder(s, n)(start(pos, s.length)),
  lastIndexOf(s, n, pos) {  // the last `n` at or before pos, on slices from the end
    const p = +pos, until = p !== p ? s.length : start(p, s.length), m = n.length, w = width(n);
    for (let i = until < s.length - m ? until : s.length - m; i >= 0; i -= w) {
      const lo = i - w + 1 > 0 ? i - w + 1 : 0;
      const j = apply(sLastIndexOf, apply(sSlice, s, [lo, i + m]), [n]);
      if (j !== -1) return lo + j;
    }
    return -1;
  },
  split(s, r, lim) {
    const out = [], next = finder(s, r);
    if (lim === 0) return out;
    let p = 0;
    for (let i = next(0); i !== -1; i = next(p)) {
      put(out, out.length, apply(sSlice, s, [p, i]));
      if (out.length === lim) return out;
      p = i + r.length;
    }
    put(out, out.length, apply(sSlice, s, [p]));
    return out;
  },
  replace(s, n, fn, repl) {
    const at = finder(s, n)(0);
    if (at === -1) return s;
    return apply(sSlice, s, [0, at]) + replacement(fn, repl, n, at, s) + apply(sSlice, s, [at + n.length]);
  },
  replaceAll(s, n, fn, repl) {
    const next = finder(s, n);
    let out = "", end = 0;
    for (let at = next(0); at !== -1; at = next(at + n.length)) {
      out += apply(sSlice, s, [end, at]) + replacement(fn, repl, n, at, s);
      end = at + n.length;
    }
    return out + apply(sSlice, s, [end]);
  },
  // A guest's exec result that is not a short genuine array (js_guards.js, the regexp facade), read
  // once here as RegExp.prototype[Symbol.replace] and [Symbol.split] read it (its length, each index
  // up to it, index, groups), each read polled: the natives read the copy, in one loop (~0.1 us a
  // capture), so past CAPTURES_MAX it is refused (the native exec makes at most 256; a replacement
  // function is called with the captures as its arguments, of which QuickJS takes at most 65,535).
  execResult(r) {
    const n = toLength(r.length);
    if (n > CAPTURES_MAX)
      throw new RangeError("a RegExp exec result of length " + n + ": the sandbox allows at most " + CAPTURES_MAX +
                           " (the match and its captures): return fewer from exec");
    const a = [];
    for (let k = 0; k < n; k++) put(a, k, r[k]);
    put(a, "index", r.index);
    put(a, "groups", r.groups);
    return a;
  },
  // A default sort (inPlace) or toSorted of the genuine array `a` (js_guards.js, sortTraps): its
  // values read once (holes skipped, undefined counted), in runs of SORT_RUN sorted by the native
  // (`sort`: the default order, stable), each value then made a string once, and the runs merged in
  // bytecode by those strings (stable: the left run first on ties). The values are written back as
  // the native writes them (undefined after them, holes deleted at the end), or into a new array
  // (toSorted: holes read as undefined).
  sorted(sort, a, inPlace, how) {
    const n = a.length, vals = filled(n);
    let m = 0, undef = 0;
    for (let i = 0; i < n; i++) {
      if (inPlace && !(i in a)) continue;
      const v = a[i];
      if (v === undefined) undef++;
      else vals[m++] = v;
    }
    // (measured here, on what was read: the runs' native sort compares with `how(vals)`, polled
    // calls if their strings are long)
    let src = filled(m), keys = filled(m), dst = filled(m), dkeys = filled(m), args = how(vals);
    for (let lo = 0; lo < m; lo += SORT_RUN) {
      const hi = lo + SORT_RUN < m ? lo + SORT_RUN : m, run = filled(hi - lo);
      for (let i = lo; i < hi; i++) run[i - lo] = vals[i];
      apply(sort, run, args);
      for (let i = lo; i < hi; i++) { const v = run[i - lo]; src[i] = v; keys[i] = text(v); }
    }
    for (let w = SORT_RUN; w < m; w *= 2) {
      for (let lo = 0; lo < m; lo += 2 * w) {
        const mid = lo + w < m ? lo + w : m, hi = lo + 2 * w < m ? lo + 2 * w : m;
        let i = lo, j = mid, k = lo;
        while (i < mid && j < hi) {
          if (keys[j] < keys[i]) { dst[k] = src[j]; dkeys[k++] = keys[j++]; }
          else { dst[k] = src[i]; dkeys[k++] = keys[i++]; }
        }
        while (i < mid) { dst[k] = src[i]; dkeys[k++] = keys[i++]; }
        while (j < hi) { dst[k] = src[j]; dkeys[k++] = keys[j++]; }
      }
      const t = src, tk = keys;
      src = dst; keys = dkeys; dst = t; dkeys = tk;
    }
    if (!inPlace) {
      const out = filled(n);  // (toSorted: undefined for the undefined and the holes, after the values)
      for (let k = 0; k < n; k++) out[k] = k < m ? src[k] : undefined;
      return out;
    }
    let k = 0;
    for (; k < m; k++) a[k] = src[k];
    for (let u = 0; u < undef; u++, k++) a[k] = undefined;
    for (; k < n; k++) delete a[k];
    return a;
  },
  // Array.prototype.join (the native `join`) of a long genuine array (js_guards.js, joinTraps): its
  // separator made a string once, then runs of JOIN_RUN elements joined natively, each copied by the
  // native slice when that makes a plain array (no `constructor` of the guest's: checked at each
  // run, an element's toString may run between), else here (holes read as undefined).
  join(join, a, sep) {
    const s = sep === undefined ? "," : text(sep), n = a.length;
    let out = "";
    for (let lo = 0; lo < n; lo += JOIN_RUN) {
      const hi = lo + JOIN_RUN < n ? lo + JOIN_RUN : n;
      let run;
      if (plainSpecies(a)) run = apply(arraySlice, a, [lo, hi]);
      else { run = filled(hi - lo); for (let i = lo; i < hi; i++) run[i - lo] = a[i]; }
      const part = apply(join, run, [s]);
      out = lo ? out + s + part : part;
    }
    return out;
  },
  // Object.fromEntries, as the native: each entry an object, its 0 and 1 read, defined as own data.
  fromEntries(entries) {
    if (entries == null) throw new TypeError("Object.fromEntries: the entries are " + entries + ", not an iterable");
    const o = {};
    for (const e of entries) {
      if (e === null || (typeof e !== "object" && typeof e !== "function"))
        throw new TypeError("Object.fromEntries: an entry is " + (e === null ? "null" : typeof e) + ", not an object");
      const k = e[0];
      put(o, k, e[1]);
    }
    return o;
  },
  // A proxy ownKeys trap's result `r` as the genuine array the native makes of it (each element read
  // once, a string or a symbol), refused past OWN_KEYS_MAX comparisons of the native's checks (the
  // keys with each other and with the target's: reading the target's keys runs its own trap).
  ownKeys(r, target) {
    if (r === null || (typeof r !== "object" && typeof r !== "function"))
      throw new TypeError("proxy: the ownKeys trap returned " + (r === null ? "null" : typeof r) + ", not a list");
    const n = toLength(r.length), tooMany = (t) => new RangeError("proxy: the ownKeys trap returned " + n + " keys" +
      (t ? " for a target of " + t : "") + "; the sandbox allows at most " + OWN_KEYS_MAX + " as keys x (keys + the " +
      "target's keys), which the native compares in one loop: return fewer keys");
    if (n * n > OWN_KEYS_MAX) throw tooMany(0);
    const keys = [];
    for (let k = 0; k < n; k++) {
      const v = r[k];
      if (typeof v !== "string" && typeof v !== "symbol")
        throw new TypeError("proxy: the ownKeys trap returned a " + (v === null ? "null" : typeof v) + " at " + k +
                            " (keys are strings or symbols)");
      put(keys, k, v);
    }
    const t = ownKeys(target).length;
    if (n * (n + t) > OWN_KEYS_MAX) throw tooMany(t);
    return keys;
  },
  // A JSON text's object keys (js_guards.js, JSON.parse), each hashed as QuickJS hashes an atom:
  // past COLLIDING distinct keys in one bucket (the hash's low 12 bits: 4,800 keys of 58 whole
  // hashes, 83 each, crowded one bucket for 230 ms) the text is refused. Strings are found left to right
  // (outside them valid JSON has no quote); a string followed by a colon is a key. `groups` is
  // keyed by the bucket (an integer atom); `seen` by the keys, so that each distinct one is hashed
  // here once.
  keys(s) {
    const groups = {__proto__: null}, seen = {__proto__: null}, n = s.length;
    for (let i = apply(sIndexOf, s, ['"', 0]); i !== -1; i = apply(sIndexOf, s, ['"', i + 1])) {
      let end = i, slashes = 1;
      while (slashes % 2 === 1) {  // the closing quote: one not escaped by an odd run of backslashes
        end = apply(sIndexOf, s, ['"', end + 1]);
        if (end === -1) return;  // unterminated: the native refuses it
        slashes = 0;
        for (let b = end - 1; b > i && apply(sCharCodeAt, s, [b]) === 92; b--) slashes++;
      }
      let c = end + 1, ch = 32;
      while (c < n && ((ch = apply(sCharCodeAt, s, [c])) === 32 || ch === 9 || ch === 10 || ch === 13)) c++;
      if (c < n && ch === 58) {  // ':'
        let key = apply(sSlice, s, [i + 1, end]);
        if (apply(sIndexOf, key, ["\\"]) !== -1) {
          try { key = parse(apply(sSlice, s, [i, end + 1])); } catch (_) { return; }  // the native refuses it
        }
        if (seen[key] === undefined) {  // (an atom lookup: the native's own, one key at a time)
          seen[key] = 1;
          let h = 1;
          for (let k = 0; k < key.length; k++) h = (h * 263 + apply(sCharCodeAt, key, [k])) % 4294967296;
          h %= 4096;  // the bucket's low bits (js_atoms.py): few 4-character keys share a whole hash
          const count = (groups[h] ?? 0) + 1;
          if (count > COLLIDING)
            throw new RangeError("JSON.parse: the text has more than " + COLLIDING + " distinct keys in one " +
                                 "bucket (QuickJS's atom table compares each new key with all of them, in one " +
                                 "native loop); the sandbox allows at most " + COLLIDING + ": use other keys");
          groups[h] = count;
        }
      }
      i = end;
    }
  },
  // An array-like replacer as the genuine array of strings the native makes of it (each element
  // read once; a number, a String or a Number object made a string, anything else dropped). The
  // native looks every key up in the keys before it (js_array_includes, no poll): n x m string
  // comparisons, and 100,000 short keys ran 18 s at 16 MiB. Past REPLACER_MAX comparisons (the
  // keys times their characters) it is refused.
  replacer(r) {
    const n = toLength(r.length);
    if (n > MAX_LENGTH) throw tooLong("JSON.stringify's replacer", n);
    const keys = [];
    let chars = 0;
    for (let k = 0; k < n; k++) {
      let v = r[k];
      if (typeof v === "object" && v !== null && (boxed(numValueOf, v) || boxed(strValueOf, v))) v = text(v);
      else if (typeof v === "number") v = text(v);
      if (typeof v !== "string") continue;
      chars += v.length + 1;
      if (keys.length * chars > REPLACER_MAX)
        throw new RangeError("JSON.stringify's replacer list of " + n + " keys: its first " + (keys.length + 1) +
                             " keys have " + chars + " characters, and the native compares each key with the ones " +
                             "before it; the sandbox allows at most " + REPLACER_MAX + " as keys x characters: " +
                             "pass fewer keys or a replacer function");
      put(keys, keys.length, v);
    }
    return keys;
  },
  // An array-like as a genuine array, its length read once and each element once, in order,
  // from this (polled) loop. Past MAX_LENGTH it is refused (the natives take at most 65,535
  // arguments or allocate per element: none of them gets that far).
  // An iterable's values, stepped here (IterableToList, as the natives read it).
  iterated(v) {
    const it = apply(v[ITERATOR], v, []);
    if (it === null || (typeof it !== "object" && typeof it !== "function"))
      throw new TypeError("the iterator is not an object");
    const next = it.next, a = [];
    for (let n = 0; ; n++) {
      const r = apply(next, it, []);
      if (r === null || (typeof r !== "object" && typeof r !== "function"))
        throw new TypeError("the iterator result is not an object");
      if (r.done) return a;
      put(a, n, r.value);
    }
  },
  list(o) {
    const n = toLength(o.length);
    if (n > MAX_LENGTH) throw tooLong("a list (an argument list or an array-like source)", n);
    if (n <= 1 << 16) {  // (an argument list's most: its elements made first, each write then ~1/20 of put's)
      const a = filled(n);
      for (let k = 0; k < n; k++) a[k] = o[k];
      return a;
    }
    const a = [];  // (grown as it is read: a huge length meets the deadline, not the memory cap, first)
    for (let k = 0; k < n; k++) put(a, k, o[k]);
    return a;
  },
  // Object.defineProperties' (and Object.create's) properties object as one whose descriptors
  // are plain objects with no prototype: read here as ToPropertyDescriptor reads them (own
  // enumerable keys in order, then each descriptor's fields, `in` before each read). What is
  // not an object is handed on for the native to refuse as it would.
  descriptors(props) {
    if (props === null || (typeof props !== "object" && typeof props !== "function")) return props;
    // Index loops: `for...of` would call Array.prototype[Symbol.iterator], the guest's by now.
    const out = {__proto__: null}, keys = ownKeys(props);
    for (let i = 0; i < keys.length; i++) {
      const k = keys[i], own = getOwnDescriptor(props, k);
      if (own === undefined || !own.enumerable) continue;
      const d = props[k];
      if (d === null || (typeof d !== "object" && typeof d !== "function")) { out[k] = d; continue; }
      const desc = {__proto__: null};
      for (let j = 0; j < FIELDS.length; j++) if (FIELDS[j] in d) desc[FIELDS[j]] = d[FIELDS[j]];
      out[k] = desc;
    }
    return out;
  },
  // Object.assign onto a target with a long prototype chain: each source's own enumerable
  // properties copied one by one from this (polled) loop, each by the native onto the target.
  assign(target, sources) {
    for (let i = 0; i < sources.length; i++) {
      const s = sources[i];
      if (s == null) continue;
      const from = toObject(s), keys = ownKeys(from);
      for (let j = 0; j < keys.length; j++) {
        const k = keys[j], own = getOwnDescriptor(from, k);
        if (own !== undefined && own.enumerable && !reflectSet(target, k, from[k], target))
          throw new TypeError("Object.assign: cannot assign to read only property " +
                              (typeof k === "symbol" ? "(a symbol)" : "'" + k + "'"));
      }
    }
    return target;
  },
  // Math.sumPrecise's argument, with its iterator stepped in bytecode (`stepped`); a value that is
  // not iterable is handed on for the native to refuse as it would.
  iterable(items, stepped) {
    if (items == null) return items;
    const f = items[ITERATOR];
    if (typeof f !== "function") return items;
    return {[ITERATOR]() {
      const it = apply(f, items, []);
      return it !== null && typeof it === "object" ? stepped(it) : it;
    }};
  },
  // A Set method's other operand as a set-like record (read once, in the native's order: size,
  // has, keys) whose keys() iterator is stepped in bytecode; has and keys are called on `other`.
  setLike(other, stepped) {
    if (other === null || (typeof other !== "object" && typeof other !== "function")) return other;
    const size = other.size, has = other.has, keys = other.keys;
    if (typeof has !== "function" || typeof keys !== "function") return {size, has, keys};
    return {
      size,
      has(v) { return apply(has, other, [v]); },
      keys() {
        const it = apply(keys, other, []);
        return it !== null && typeof it === "object" ? stepped(it) : it;
      },
    };
  },
  raw(template, subs) {  // in bytecode: its loop is over the guest's `raw.length`
    if (template == null) throw new TypeError("String.raw: the template is null or undefined");
    const raw = toObject(template).raw;
    if (raw == null) throw new TypeError("String.raw: the template has no raw strings");
    const lits = toObject(raw), n = toLength(lits.length);
    let out = "";
    for (let i = 0; i < n; i++) {
      out += text(lits[i]);
      if (i + 1 < n && i < subs.length) out += text(subs[i]);
    }
    return out;
  },
};
