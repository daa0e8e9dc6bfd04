  // Guards on the built-ins whose native work a guest can make unbounded (plugins/runtimes/js.py
  // inlines this block into the prelude, inside its function, before any guest code runs; it
  // uses the prelude's `g`, `assign` and `stringify`). QuickJS polls for interrupts in its
  // bytecode loop and its regexp engine only, never inside a built-in's C loop, so every built-in
  // whose C loop grows with a length or a product of lengths the guest controls is bounded here
  // before it starts, or has its work moved where the polls are (a bytecode loop). This part only
  // checks; the slow paths (js_guards_slow.js) are compiled in a Context the first time it needs
  // one: every byte here is read and run in each new Context (~7 us per KB of bytecode).
  const apply = Reflect.apply, isArray = Array.isArray, NativeFunction = Function, NativeProxy = Proxy, NativeArray = Array;
  const reflectGet = Reflect.get, nativeConstruct = Reflect.construct, defineProp = Reflect.defineProperty, toObject = Object, trunc = Math.trunc,
        clz32 = Math.clz32;
  const SPLIT = Symbol.split, REPLACE = Symbol.replace, MATCH = Symbol.match, spreadable = Symbol.isConcatSpreadable;
  const ITER = Symbol.iterator, reflectSet = Reflect.set, ownKeys = Reflect.ownKeys;
  const getOwnDescriptor = Reflect.getOwnPropertyDescriptor, numValueOf = Number.prototype.valueOf;
  const arraySpeciesGet = getOwnDescriptor(NativeArray, Symbol.species).get;
  const NativeRegExp = RegExp, rxReplace = RegExp.prototype[REPLACE];
  const AP = Array.prototype, SP = String.prototype, MAX_LENGTH = 1 << 22, SEARCH_MAX = 1 << 22, SHORT = 8;
  const tooLong = (what, n) => new RangeError(what + " on a length of " + n + ": the sandbox allows at most " +
                                              MAX_LENGTH);
  const toLength = (v) => { v = +v; return v > 0 ? (v < 2 ** 53 ? trunc(v) : 2 ** 53 - 1) : 0; };
  const text = (v) => typeof v === "string" ? v : `${v}`;  // ToString: throws on a Symbol, as natives do
  const sIndexOf = SP.indexOf, sLastIndexOf = SP.lastIndexOf, sIncludes = SP.includes, sSplit = SP.split,
        sReplace = SP.replace, sReplaceAll = SP.replaceAll, sSlice = SP.slice, strValueOf = SP.valueOf,
        sCharCodeAt = SP.charCodeAt;

  // -- Proxies: a trap may report one length to a guard and another to the native reading it
  // next. Every proxy the guest makes is known, so "a genuine array" (whose length is data) is.
  const proxies = new WeakSet(), addProxy = WeakSet.prototype.add, isProxy = WeakSet.prototype.has;
  const nativeRevocable = Proxy.revocable;
  // A proxy's ownKeys trap hands the native a list it checks for duplicates key by key, and against
  // the target's keys, in C (n x n: 100,000 keys ran 1.3 s in one Object.keys at 16 MiB). Each
  // handler is seen through an object whose prototype it is (its traps found there, called with
  // that object as `this`) with an ownKeys of ours: the guest's trap, then its result read once
  // into a genuine array and, past SHORT_KEYS keys, bounded (slow().ownKeys).
  const nativeCreate = Object.create, SHORT_KEYS = 64;
  const keysTrap = {__proto__: null, ownKeys: {__proto__: null, value(target) {
    const h = getProto(this), trap = h.ownKeys;
    if (trap == null) return ownKeys(target);
    const r = apply(trap, h, [target]);
    return genuine(r) && r.length <= SHORT_KEYS ? r : slow().ownKeys(r, target);
  }}};
  const guarded = (h) => h !== null && (typeof h === "object" || typeof h === "function") ? nativeCreate(h, keysTrap) : h;
  g.Proxy = function Proxy(target, handler) {
    if (new.target === undefined) throw new TypeError("Proxy must be called with new");
    const p = new NativeProxy(target, guarded(handler));
    apply(addProxy, proxies, [p]);
    return p;
  };
  g.Proxy.revocable = (target, handler) => {
    const r = apply(nativeRevocable, NativeProxy, [target, guarded(handler)]);
    apply(addProxy, proxies, [r.proxy]);
    return r;
  };
  // ... and whose prototype chain is short: a hole is looked up (and a write looks for a setter)
  // along the chain in C, with no poll, so a sparse array whose chain is 1,000 objects deep made
  // `a.slice()` of 4M holes 4 billion steps (it ran for minutes). An array with a longer chain
  // (or any array, once Array.prototype's own chain is made longer) takes the view path.
  const getProto = Object.getPrototypeOf, SHORT_CHAIN = 8;
  const shallow = (o) => {  // at most SHORT_CHAIN prototypes behind o (o itself is no proxy)
    for (let i = 0; i <= SHORT_CHAIN && o !== null; i++) o = getProto(o);
    return o === null;
  };
  const shortChain = (o) => !apply(isProxy, proxies, [o]) && shallow(o);
  const genuine = (o) => isArray(o) && shortChain(o);

  let slowPaths = null;
  const taNatives = {__proto__: null};  // filled in with the typed arrays' natives below
  // Everything the slow paths use was captured above, before any guest code: a guest's own
  // String.prototype.slice, say, could hand a native search the whole string again. Their text
  // is a tagged template's (cooked) string: the bytecode carries that as a plain string, copied
  // as it is read, where a string literal is an atom, hashed in full in every new Context
  // (~10,000 characters: ~70,000 instructions, a twentieth of the prelude).
  const slow = () => slowPaths ??= NativeFunction("c", ((t) => t[0])__GUARDS_SLOW__)({
    apply, reflectGet, defineProp, isArray, toObject, trunc, NativeProxy, rxReplace, sIndexOf, sLastIndexOf,
    sSlice, spreadable, text, toLength, genuine, SEARCH_MAX, MAX_LENGTH, tooLong, reflectSet, ownKeys,
    getOwnDescriptor, ITERATOR: ITER, TA: taNatives,
    numValueOf, strValueOf, parse, sCharCodeAt, SORT_RUN, arrayFill: original[fillAt], JOIN_RUN, arraySlice: original[sliceAt], AP, NativeArray,
    speciesGet: arraySpeciesGet, hasOwn, getProto, SPECIES, nativeExec});

  // -- Array.prototype: its methods walk `length` in C (`a.length = 2**31; a.join()`, indexOf,
  // fill, sort, forEach over holes... ran for minutes). Each refuses a length past MAX_LENGTH,
  // which no real array within the memory limit has. A genuine array's and a string's length is
  // data; any other receiver's is read once, and the native gets a view that reports that value.
  // Each method is replaced by a proxy of the native whose one trap, apply (shared by all of
  // them), checks the receiver, then calls the native it is handed (the proxy's target, which a
  // proxy never hands out). Name, length, no prototype and no [[Construct]] are the native's own,
  // forwarded. A proxy costs a fraction of a wrapper function, each of which was a function
  // read, a closure made and freed in every Context (~5,000 instructions a method).
  // The originals are written out by Python (_GUARDED_METHODS) as one array literal.
  const original = __GUARDED_ORIGINALS__, names = __GUARDED_NAMES__;
  // (the natives' indexOf, still)
  const sortAt = names.indexOf("sort"), fillAt = names.indexOf("fill"), sliceAt = names.indexOf("slice");
  const nameOf = (native) => {  // (only for a message or the slow path: a scan of 29)
    for (let i = 0; i < original.length; i++) if (original[i] === native) return names[i];
  };
  // `args` is a genuine array the engine made for this call.
  const arrayTraps = {__proto__: null, apply(native, self, args) {
    if (self == null || typeof self === "string" || genuine(self)) {
      if (self != null && self.length > MAX_LENGTH) throw tooLong("Array.prototype." + nameOf(native), self.length);
      return apply(native, self, args);
    }
    return slow().view(native, self, args, nameOf(native));
  }};
  // indexOf, lastIndexOf and includes compare their search value with each element natively: a
  // string costs up to its length at every element, and one string may fill a whole array
  // (`new Array(2e5).fill(x).indexOf(y)`, x and y 2 MB strings that differ at their ends, ran 7 s
  // past a 0.3 s deadline at the default 16 MiB). On a genuine array, past SEARCH_MAX character
  // comparisons with a string over SHORT characters, the search runs in bytecode, polled at each
  // element (any other receiver is read through the view's traps: a polled call per element).
  const searchTraps = {__proto__: null, apply(native, self, args) {
    const v = args.length > 0 ? args[0] : undefined;
    if (typeof v === "string" && v.length > SHORT && genuine(self) && self.length <= MAX_LENGTH &&
        v.length * self.length > SEARCH_MAX)
      return slow().search(nameOf(native), self, v, args);
    return arrayTraps.apply(native, self, args);
  }};
  // One string of millions of characters can also fill a list whose every element a native converts
  // or compares, paying that length at each one (ToNumber copies the whole string): a typed array
  // made of `new Array(2e5).fill(x)`, x a 2 MB string, ran over 30 s at 16 MiB, and a default sort
  // of 2,000 such strings (differing at their ends) 1.07 s. mass(a): the characters of a genuine
  // array's strings, each counted at every element that holds it, summed in bytecode (polled) up to
  // past `max` (a typed array's source of at most FEW elements is not read: milliseconds at most).
  const FEW = 64, MASS_MAX = 1 << 30;
  const mass = (a, max) => {
    let m = 0;
    for (let i = 0, n = a.length; i < n && m <= max; i++) { const v = a[i]; if (typeof v === "string") m += v.length; }
    return m;
  };
  // sort and toSorted without a comparator compare ToString of each pair, natively. Past MASS_MAX
  // characters compared (mass times log2 of the length) the native sorts with a comparator that
  // compares as the default order does (each comparison a polled call; undefined and holes still go
  // last, never compared). Past SORT_MAX comparisons (the length times its log2: a default sort of
  // 2M numbers ran 4.2 s at 256 MiB, of 2M short strings up to 1.8 s), runs of SORT_RUN elements
  // are sorted natively and merged in bytecode (slow().sorted).
  const SORT_MAX = 1 << 21, SORT_RUN = 1 << 17;
  const byText = (x, y) => { const s = text(x), t = text(y); return s < t ? -1 : s > t ? 1 : 0; };
  // The values are read once, into a copy that is measured and sorted, then written back as the
  // native writes them (undefined after the values, holes deleted at the end; toSorted: a new array,
  // holes read as undefined): an element's getter, or a hole's prototype, runs guest code while the
  // array is read, and had it swap 3,000 references to one 4 MiB string in after the measure (7.8 s
  // of native sort on a 0.3 s budget).
  const sortTraps = {__proto__: null, apply(native, self, args) {
    if ((args.length === 0 || args[0] === undefined) && genuine(self) && self.length > 1 &&
        self.length <= MAX_LENGTH) {
      const n = self.length, log2 = 32 - clz32(n), inPlace = native === original[sortAt], sort = original[sortAt];
      if (n * log2 > SORT_MAX) return slow().sorted(sort, self, inPlace, (a) => mass(a, MASS_MAX / log2) >
                                                    MASS_MAX / log2 ? [byText] : []);
      const vals = [];
      let m = 0, undef = 0;
      for (let i = 0; i < n; i++) {
        if (inPlace && !(i in self)) continue;
        const v = self[i];
        if (v === undefined) undef++; else vals[m++] = v;
      }
      apply(sort, vals, mass(vals, MASS_MAX / log2) > MASS_MAX / log2 ? [byText] : []);
      if (!inPlace) {
        for (let u = 0; u < undef; u++) vals[m++] = undefined;
        for (; m < n; m++) vals[m] = undefined;
        return vals;
      }
      let k = 0;
      for (; k < m; k++) self[k] = vals[k];
      for (let u = 0; u < undef; u++, k++) self[k] = undefined;
      for (; k < n; k++) delete self[k];
      return self;
    }
    return arrayTraps.apply(native, self, args);
  }};
  // join (and toString, which calls it) makes each element a string in one native loop: a number
  // costs ~0.3 us, and 4M of them ran 1.25 s at 384 MiB. Past JOIN_MAX elements a genuine array is
  // joined in runs of JOIN_RUN, each copied in bytecode and joined natively (slow().join).
  const JOIN_MAX = 1 << 18, JOIN_RUN = 1 << 16;
  const joinTraps = {__proto__: null, apply(native, self, args) {
    if (genuine(self) && self.length > JOIN_MAX && self.length <= MAX_LENGTH)
      return slow().join(native, self, args.length > 0 ? args[0] : undefined);
    return arrayTraps.apply(native, self, args);
  }};
  // Set, not defined: each property stays writable, configurable and not enumerable.
  for (let i = 0; i < names.length; i++) {
    const n = names[i];
    AP[n] = new NativeProxy(original[i], n === "indexOf" || n === "lastIndexOf" || n === "includes" ? searchTraps :
                                         n === "sort" || n === "toSorted" ? sortTraps :
                                         n === "join" ? joinTraps : arrayTraps);
  }
  // concat also walks its arguments, and flat/flatMap the arrays nested in their receiver: their
  // lengths are not the receiver's. concat runs natively on genuine arrays (and primitives) whose
  // lengths add up to at most MAX_LENGTH, in bytecode otherwise; flat and flatMap in bytecode.
  const nativeConcat = AP.concat;
  const receiver = (self, name) => {
    if (self == null) throw new TypeError("Array.prototype." + name + " called on null or undefined");
    return toObject(self);
  };
  assign(AP, {
    concat(...items) {
      const o = receiver(this, "concat");
      let total = genuine(o) ? o.length : -1;
      for (let j = 0; j < items.length && total >= 0; j++) {
        const e = items[j];
        if (e !== null && (typeof e === "object" || typeof e === "function")) total = genuine(e) ? total + e.length : -1;
      }
      return total >= 0 && total <= MAX_LENGTH ? apply(nativeConcat, o, items) : slow().concat(o, items);
    },
    flat(depth) {
      const o = receiver(this, "flat");
      let d = depth === undefined ? 1 : +depth;
      d = d !== d ? 0 : trunc(d);
      return slow().flat(o, d < 0 ? 0 : d);
    },
    flatMap(mapper, thisArg) {
      const o = receiver(this, "flatMap");
      if (typeof mapper !== "function") throw new TypeError("Array.prototype.flatMap: the mapper is not a function");
      return slow().flat(o, 1, mapper, thisArg);
    },
  });

  // -- Iterators: QuickJS calls a built-in iterator's `next` (an array's, a string's, a Set's) from
  // C without going through a call, so a C loop that drives one and calls nothing else per
  // element never polls: over a sparse 2**32 length, `a.values().drop(2**31)`, `.includes(1)`,
  // `.join("")`, `Math.sumPrecise(a.keys())` and the Set methods that walk another set-like's
  // `keys()` (`new Set().union({size: 1, has, keys: () => a.values()})`) ran for minutes. These
  // see their iterator through a map whose step is bytecode: one polled call per element. (The
  // helpers that take a callback, filter, some, find, reduce..., already call per element, and
  // the ones that collect, toArray, Array.from, chunks..., meet the memory cap.)
  const IP = typeof Iterator === "function" ? Iterator.prototype : null, nativeMap = IP && IP.map;
  const pass = (v) => v, stepped = (it) => apply(nativeMap, it, [pass]);
  // Each of these natives is replaced by a proxy of it whose apply trap (one per kind) steps the
  // iterator: name and length are the native's own, forwarded (see arrayTraps). `args` is a
  // genuine array the engine made for the call.
  const proxied = (o, names, traps) => {
    for (let i = 0; i < names.length; i++) {
      const native = o[names[i]];
      if (typeof native === "function") o[names[i]] = new NativeProxy(native, traps);
    }
  };
  if (typeof nativeMap === "function") {
    proxied(IP, ["drop", "includes", "join"],
            {__proto__: null, apply: (native, self, args) => apply(native, stepped(self), args)});
    const nativeSum = Math.sumPrecise;
    if (typeof nativeSum === "function")
      assign(Math, {sumPrecise(items) { return apply(nativeSum, Math, [slow().iterable(items, stepped)]); }});
    proxied(Set.prototype, ["union", "intersection", "difference", "symmetricDifference", "isSupersetOf",
                            "isDisjointFrom"], {__proto__: null, apply: (native, self, args) =>
      apply(native, self, [slow().setLike(args.length > 0 ? args[0] : undefined, stepped)])});
  }

  // -- Argument lists a native converts one by one: `Math.max(...a)` or `String.fromCharCode.apply(
  // null, a)` with 65,535 references to one 2 MB string ran ~10 s at 16 MiB in one C loop (a
  // string's ToNumber copies it whole). Past SEARCH_MAX characters of string arguments, each counted
  // at every argument that holds it, the strings are made numbers here first, one polled step each,
  // as the native would (a string's ToNumber runs no guest code), and the native gets the numbers.
  const numbered = {__proto__: null, apply(native, self, args) {
    if ((args.length > 2 || typeof args[0] === "string" || typeof args[1] === "string") &&
        mass(args, SEARCH_MAX) > SEARCH_MAX)
      for (let i = 0; i < args.length; i++) if (typeof args[i] === "string") args[i] = +args[i];
    return apply(native, self, args);
  }};
  proxied(Math, ["max", "min", "hypot"], numbered);
  proxied(String, ["fromCharCode", "fromCodePoint"], numbered);

  // -- Lists read by index in C: an argument list (apply, Reflect.apply, Reflect.construct), an
  // array's iterator (spread, Array.from, a typed array made from an iterable) and an array-like
  // source (Array.from, a typed array's from and set). Each missing index is looked up along the
  // source's prototype chain in C, and a chain 30,000 objects deep made each of 65,000 lookups
  // that long (`Math.max.apply(null, a)`, `[...a]`, `Array.from(a)`: minutes). A genuine array
  // (genuine(): no proxy, a short prototype chain) goes to the native as it is;
  // any other list is copied into one in bytecode (polled), and an array iterator over anything
  // else is stepped like the iterators above.
  if (typeof nativeMap === "function") {
    // (Everything these call later is captured here: a guest's own Symbol or ArrayBuffer.isView
    // could otherwise pass a list to the native unchecked.)
    const isView = ArrayBuffer.isView;
    // (A function is an object too: its `length` can be redefined and its chain made long.)
    const primitive = (v) => v === null || (typeof v !== "object" && typeof v !== "function");
    // A list whose chain is short and which is short itself is read natively (`f.apply(this,
    // arguments)`: each lookup at most SHORT_CHAIN steps); a proxy, a long chain or more than
    // SHORT_KEYS elements are copied, in bytecode. An element's getter may re-parent the list (or
    // Array.prototype) onto a deep chain while the native reads it, and every hole after it was then
    // looked up along that chain in C (65,000 holes, a 30,000-deep chain: past 40 s).
    const list = (v) => primitive(v) || (shortChain(v) && !(v.length > SHORT_KEYS)) ? v : slow().list(v);
    const nFnApply = Function.prototype.apply, nConstruct = Reflect.construct, nFrom = Array.from;
    assign(Function.prototype, {apply(thisArg, args) { return apply(nFnApply, this, [thisArg, list(args)]); }});
    assign(Reflect, {
      apply(f, thisArg, args) { return apply(f, thisArg, list(args)); },
      construct(f, args, newTarget) {
        return arguments.length > 2 ? nConstruct(f, list(args), newTarget) : nConstruct(f, list(args));
      },
    });
    const nValues = AP.values, nEntries = AP.entries;
    const values = {values() { const it = apply(nValues, this, []); return genuine(this) ? it : stepped(it); }}.values;
    assign(AP, {values, [ITER]: values,
                entries() { const it = apply(nEntries, this, []); return genuine(this) ? it : stepped(it); }});
    // An array-like without an iterator is read by index; one with an iterator goes through it.
    const source = (v) => primitive(v) || shortChain(v) || typeof v[ITER] === "function" ? v : slow().list(v);
    // (arguments, not a spread of the rest: a spread steps Array.prototype[Symbol.iterator], the guest's)
    assign(Array, {from(items) { return apply(nFrom, this, [source(items), arguments[1], arguments[2]]); }});
    const TA = getProto(Int8Array), TAP = TA.prototype, nTAFrom = TA.from, nSet = TAP.set, nOf = TA.of;
    // What a typed array converts element by element (mass() above): a genuine array whose strings
    // pass MASS_MAX characters is refused, an array-like copied first (its length and elements read
    // once, in bytecode) and then checked; an iterable's steps are calls, polled.
    const converted = (a, what) => {
      if (a.length > FEW && mass(a, MASS_MAX) > MASS_MAX)
        throw new RangeError(what + " of " + a.length + " elements holds strings of more than " + MASS_MAX +
                             " characters in all (each counted at every element that holds it): the sandbox " +
                             "allows at most " + MASS_MAX);
      return a;
    };
    // The native converts a source's values in one loop after it has read them all (an iterable's
    // steps are polled calls, the conversion is not), so what converted() measured must be what the
    // native converts: an element's getter swapped 300 references to a 4 MiB string in after the
    // measure, and a guest's Array.prototype[Symbol.iterator] (or any iterable) yielded them, each
    // converted for 14-17 s on a 0.3 s budget. So the values are read once into a copy (by the
    // source's iterator when the native would use one, stepped in bytecode), the copy is measured,
    // and the native gets the copy as an array-like (its own Symbol.iterator undefined).
    const AIP = getProto(apply(nValues, [], [])), aipNext = AIP.next;
    const plainIteration = (v) => {  // a genuine array iterated by the natives' own iterator
      if (!genuine(v) || v[ITER] !== values) return false;
      const d = getOwnDescriptor(AIP, "next");
      return d !== undefined && d.value === aipNext;
    };
    const snapshot = (v, iterate) => {
      let out;
      if (iterate && !plainIteration(v) && typeof v[ITER] === "function") {
        out = slow().iterated(v);
      } else if (genuine(v)) {
        out = [];
        for (let i = 0, n = v.length; i < n; i++) out[i] = v[i];
      } else {
        out = slow().list(v);
      }
      defineProp(out, ITER, {value: undefined});
      return out;
    };
    const taSource = (v, what, iterate) => primitive(v) ? v : converted(snapshot(v, iterate), what);
    assign(TA, {
      from(items) {
        return apply(nTAFrom, this, [taSource(items, "a typed array's source", true), arguments[1], arguments[2]]);
      },
      of(...items) { return apply(nOf, this, converted(items, "a typed array's values")); },
    });
    // A typed array's length is bounded by the memory cap only (up to 1 GiB), and some of its
    // methods cost tens of ns per element in C: at that cap, sorting 28M doubles took 4.8 s,
    // joining 50M bytes 2.2 s, converting 300M bytes to 16 bits (set, a constructor) 7.3 s. Past
    // TA_CHUNK elements they run natively on views of at most TA_CHUNK elements from a polled
    // loop (js_guards_slow.js), with every argument made primitive first: no guest code between.
    const taLength = getOwnDescriptor(TAP, "length").get, TA_CHUNK = 1 << 18, kinds = {__proto__: null};
    const taLen = (v) => { try { return apply(taLength, v, []); } catch (_) { return -1; } };  // -1: not one
    const nSort = TAP.sort, nToSorted = TAP.toSorted, nJoin = TAP.join;
    assign(taNatives, {kinds, CHUNK: TA_CHUNK, construct: nConstruct, length: taLength, sort: nSort, join: nJoin,
                       set: nSet, fill: TAP.fill, tag: getOwnDescriptor(TAP, Symbol.toStringTag).get,
                       buffer: getOwnDescriptor(TAP, "buffer").get, offset: getOwnDescriptor(TAP, "byteOffset").get});
    assign(TAP, {
      set(items) {
        const offset = arguments[1];
        if (!isView(items)) return apply(nSet, this, [taSource(items, "a typed array's source", false), offset]);
        return taLen(items) > TA_CHUNK ? slow().taSet(this, items, offset) : apply(nSet, this, [items, offset]);
      },
      sort(cmp) {
        return cmp === undefined && apply(taLength, this, []) > TA_CHUNK ? slow().taSort(this) :
          apply(nSort, this, [cmp]);
      },
      toSorted(cmp) {
        return cmp === undefined && apply(taLength, this, []) > TA_CHUNK ? slow().taToSorted(this) :
          apply(nToSorted, this, [cmp]);
      },
      join(sep) {
        apply(taLength, this, []);  // (not a typed array: its TypeError comes before sep's toString)
        const s = sep === undefined ? "," : text(sep);
        return apply(taLength, this, []) > TA_CHUNK ? slow().taJoin(this, s) : apply(nJoin, this, [s]);
      },
    });
    // Property descriptors are read field by field (enumerable, configurable, value, writable,
    // get, set: each a lookup along the descriptor's chain) for every property at once: with a
    // 30,000-deep chain behind one descriptor used for 50,000 keys, Object.defineProperties ran
    // for minutes. They are read in bytecode, in the native's order, into plain descriptors.
    const nDefineProps = Object.defineProperties, nCreate = Object.create;
    assign(Object, {
      defineProperties(o, props) { return nDefineProps(o, slow().descriptors(props)); },
      create(proto, props) { return props === undefined ? nCreate(proto) : nCreate(proto, slow().descriptors(props)); },
      // Each key becomes an atom in one native loop, with the bucket walk JSON.parse's guard
      // describes (20,000 keys of one hash: 0.66 s): the entries are defined in bytecode instead.
      fromEntries(entries) { return slow().fromEntries(entries); },
      // Each key written looks for a setter along the target's chain: a deep one, in bytecode. So
      // are more than SHORT_KEYS keys onto a shallow one: a source's getter (or a setter on the
      // target's chain) may run guest code during the native's loop, and deepened the chain after
      // the check (20,000 keys then written along a 30,000-deep chain: 8.6 s on a 0.3 s budget).
      assign(target, ...sources) {
        if (target === null || typeof target !== "object" || apply(isProxy, proxies, [target]))
          return apply(assign, Object, arguments);
        if (!shallow(target)) return slow().assign(target, sources);
        for (let i = 0, keys = 0; i < sources.length; i++) {
          const s = sources[i];
          if (s == null) continue;
          if (typeof s === "string") keys += s.length;
          else if (typeof s !== "object" && typeof s !== "function") continue;
          else if (apply(isProxy, proxies, [s]) || isView(s)) return slow().assign(target, sources);
          else keys += ownKeys(s).length;
          if (keys > SHORT_KEYS) return slow().assign(target, sources);
        }
        return apply(assign, Object, arguments);
      },
    });
    // The typed array constructors read an array-like first argument by index too: each is
    // replaced by a proxy of the native whose one trap, construct, copies such an argument first
    // (a buffer, a view, an iterable or a genuine array goes to the native as it is). Everything
    // else (name, length, prototype, statics, subclassing, a call without new) is the native's
    // own, forwarded, and a proxy never hands out its target: only `constructor` on each
    // prototype and the global named the native. (A wrapper function per constructor, with its
    // prototype, statics and chain redefined, cost ~27,000 instructions each in every Context,
    // a sixth of the prelude; the proxies ~1,500.)
    const byteLengths = [ArrayBuffer, g.SharedArrayBuffer].map((B) =>
      typeof B === "function" ? Reflect.getOwnPropertyDescriptor(B.prototype, "byteLength").get : null);
    const isBuffer = (v) => {  // (no method calls: Array.prototype.some is the guest's by then)
      for (let i = 0; i < 2; i++) {
        const get = byteLengths[i];
        try { if (get !== null) { apply(get, v, []); return true; } } catch (_) { /* not this kind */ }
      }
      return false;
    };
    // `args` is a genuine array the engine made for this call, index 0 its own when there is
    // one: written in place, no setter. A newTarget that is the proxy itself gives the native's
    // prototype (read through the proxy, no trap).
    const taTraps = {__proto__: null, construct(N, args, nt) {
      const a = args.length > 0 ? args[0] : undefined;
      if (isView(a) && taLen(a) > TA_CHUNK) return slow().taCopy(N, a, nt);  // a typed array: set's chunks
      if (!primitive(a) && !isView(a) && !isBuffer(a)) args[0] = taSource(a, "a typed array's source", true);
      return nConstruct(N, args, nt);
    }};
    const taNames = ["Int8Array", "Uint8Array", "Uint8ClampedArray", "Int16Array", "Uint16Array", "Int32Array",
                     "Uint32Array", "Float16Array", "Float32Array", "Float64Array", "BigInt64Array", "BigUint64Array"];
    for (let i = 0; i < taNames.length; i++) {
      const name = taNames[i], N = g[name];
      if (typeof N !== "function") continue;
      const P = new NativeProxy(N, taTraps);
      kinds[name] = N;
      // (Plain writes: both are writable, configurable data properties, and keep their attributes.)
      N.prototype.constructor = P;
      g[name] = P;
    }
  }

  // -- String searches compare the needle at every start position, natively (n x m character
  // comparisons: 'a'.repeat(4e6).indexOf('a'.repeat(2e6) + 'b') ran for minutes). Past
  // SEARCH_MAX comparisons a search runs on slices of at most SEARCH_MAX comparisons each, unless
  // its needle is short (up to SHORT characters): then its cost is linear in a string the memory
  // cap bounds, like any other linear built-in's (s.split(",") on a long text stays native).
  const big = (s, n) => n.length > SHORT && s.length * n.length > SEARCH_MAX;
  const subject = (self, name) => {
    if (self == null) throw new TypeError("String.prototype." + name + " called on null or undefined");
    return text(self);
  };
  const isRegExp = (v) => v !== null && (typeof v === "object" || typeof v === "function") &&
    (v[MATCH] !== undefined ? !!v[MATCH] : v instanceof NativeRegExp);
  // A searchValue's own @@split/@@replace is called here (as the natives would), never by a
  // native that could read it again and find something else.
  const method = (v, symbol) => v == null ? undefined : v[symbol] ?? undefined;
  // A replacement string is read natively at every match (GetSubstitution): the matches times its
  // length, with no poll between matches, and a `$<` with no `>` after it scans to the end (each
  // `$<`: its length squared at one match). `'x'.repeat(2e4).replace(/(b)?x/g, '$1'.repeat(1e6))`,
  // which writes nothing, ran 412 s at 16 MiB; `s.replaceAll('', '$&'.repeat(16))` on 7M characters
  // 2.4 s. Past SUBST_MAX (the string's length + 1, at most as many matches, times the replacement's
  // length; times it again with a `$<` when captures may be named) a replacement with a `$` becomes a
  // function that substitutes in bytecode (slow().template): one polled call per match.
  const SUBST_MAX = 1 << 24;
  const heavy = (n, r, named) => {
    const w = (n + 1) * r.length;
    return (w > SUBST_MAX || (named && w * r.length > SUBST_MAX)) && apply(sIndexOf, r, ["$"]) !== -1 &&
      (w > SUBST_MAX || apply(sIndexOf, r, ["$<"]) !== -1);
  };
  assign(SP, {
    indexOf(search, pos) {
      const s = subject(this, "indexOf"), n = text(search);
      return big(s, n) ? slow().indexOf(s, n, pos) : apply(sIndexOf, s, [n, pos]);
    },
    includes(search, pos) {
      const s = subject(this, "includes");
      if (isRegExp(search)) throw new TypeError("String.prototype.includes: the search value must not be a RegExp");
      const n = text(search);
      return big(s, n) ? slow().indexOf(s, n, pos) !== -1 : apply(sIncludes, s, [n, pos]);
    },
    lastIndexOf(search, pos) {
      const s = subject(this, "lastIndexOf"), n = text(search);
      return big(s, n) ? slow().lastIndexOf(s, n, pos) : apply(sLastIndexOf, s, [n, pos]);
    },
    split(separator, limit) {
      if (this == null) throw new TypeError("String.prototype.split called on null or undefined");
      const m = method(separator, SPLIT);
      if (m !== undefined) return apply(m, separator, [this, limit]);
      const s = text(this), lim = limit === undefined ? 4294967295 : limit >>> 0;
      if (separator === undefined) return apply(sSplit, s, [undefined, lim]);
      const r = text(separator);
      return big(s, r) ? slow().split(s, r, lim) : apply(sSplit, s, [r, lim]);
    },
    replace(searchValue, replaceValue) {
      if (this == null) throw new TypeError("String.prototype.replace called on null or undefined");
      const m = method(searchValue, REPLACE);
      if (m !== undefined) return apply(m, searchValue, [this, replaceValue]);
      const s = text(this), n = text(searchValue);
      let fn = typeof replaceValue === "function", repl = fn ? replaceValue : text(replaceValue);
      if (!fn && heavy(s.length, repl, false)) { repl = slow().template(repl); fn = true; }
      return big(s, n) ? slow().replace(s, n, fn, repl) : apply(sReplace, s, [n, repl]);
    },
    replaceAll(searchValue, replaceValue) {
      if (this == null) throw new TypeError("String.prototype.replaceAll called on null or undefined");
      if (isRegExp(searchValue)) {
        const flags = searchValue.flags;
        if (flags == null || apply(sIndexOf, text(flags), ["g"]) < 0)
          throw new TypeError("String.prototype.replaceAll: a RegExp search value must have the g flag");
      }
      const m = method(searchValue, REPLACE);
      if (m !== undefined) return apply(m, searchValue, [this, replaceValue]);
      const s = text(this), n = text(searchValue);
      let fn = typeof replaceValue === "function", repl = fn ? replaceValue : text(replaceValue);
      if (!fn && heavy(s.length, repl, false)) { repl = slow().template(repl); fn = true; }
      return big(s, n) ? slow().replaceAll(s, n, fn, repl) : apply(sReplaceAll, s, [n, repl]);
    },
  });

  // -- A regular expression's literal characters are matched at each start position with no poll
  // in between: a 2,000,000-character pattern against a 4 MB string ran for minutes, a 30,000-
  // character one stays within ~0.1 s of a deadline. exec, which test, match, matchAll, search,
  // replace and split all call, refuses a pattern longer than MAX_PATTERN (its source, read with
  // the native getter: a guest's own `source` could say anything).
  const RP = NativeRegExp.prototype, nativeExec = RP.exec, MAX_PATTERN = 1 << 14;

  // -- normalize, and localeCompare (which normalizes both strings), put each run of combining
  // marks in canonical order with an insertion sort in C: its length squared, no poll (one
  // normalize of 'a' + '\u0301\u0323'.repeat(1e5), 400 KB, ran 21 s). Past MARK_WORK (the runs'
  // lengths squared, summed; runs of at most 32 counted as nothing: linear work) it is refused.
  // Every character of a nonzero combining class is a mark (\p{M}), or decomposes to one (U+FF9E-F).
  const MARKS = new NativeRegExp("[\\p{M}\\uFF9E\\uFF9F]{33,}", "gu"), MARK_WORK = 1 << 26;
  const sNormalize = SP.normalize, sLocaleCompare = SP.localeCompare;
  const marked = (s, name) => {
    if (s.length <= 1 << 13) return s;  // at most 2**26 however its marks run
    let work = 0, m;
    MARKS.lastIndex = 0;
    while ((m = apply(nativeExec, MARKS, [s])) !== null) {
      if ((work += m[0].length * m[0].length) > MARK_WORK)
        throw new RangeError("String.prototype." + name + " on runs of combining marks of " + work +
                             " (their lengths squared): the sandbox allows at most " + MARK_WORK);
    }
    return s;
  };
  assign(SP, {
    normalize() { return apply(sNormalize, marked(subject(this, "normalize"), "normalize"), arguments); },
    localeCompare(that) {
      const s = subject(this, "localeCompare"), t = text(that);
      return apply(sLocaleCompare, marked(s, "localeCompare"), [marked(t, "localeCompare")]);
    },
  });
  // RegExp.prototype[Symbol.replace] (String.prototype.replace and replaceAll call it for a regexp):
  // its string and replacement made strings here, in the native's order, the replacement a function
  // past SUBST_MAX (above). A proxy of the native: name and length are its own.
  // Both it and RegExp.prototype[Symbol.split] read each exec result's length, then every capture
  // up to it, in one native loop, each missing index looked up along the result's prototype chain
  // (a guest's exec returning 6,000 captures behind a chain 30,000 deep ran 9.8 s in replace, 19.8 s
  // in split, at 16 MiB). Which exec runs is read by the native after guest code (a `flags` getter)
  // may have swapped it, so it is never checked first: the natives see the regexp (and split's
  // splitter) through a facade whose `exec` hands them a result that is a genuine array of at most
  // FEW elements, or its copy made in bytecode (slow().execResult; a genuine array's holes cost
  // little each, but its length is the guest's: 2**32 - 1 ran 2.7 s at 256 MiB). Every other read and
  // write goes to the regexp itself, with it as the receiver: a getter sees the regexp, not us.
  // Each facade has its own handler (the traps' `this`), which keeps the exec last read and what it
  // hands the native for it: one closure per call, not per match.
  const SPECIES = Symbol.species, facade = (t) => new NativeProxy(t, {__proto__: facadeTraps, f: null, exec: null});
  const isObject = (v) => v !== null && (typeof v === "object" || typeof v === "function");
  const facadeTraps = {__proto__: null, set: (t, k, v) => reflectSet(t, k, v, t), get(t, k) {
    if (k === "exec") {
      let f = reflectGet(t, k, t);
      if (typeof f !== "function") f = checkedExec;  // (the native then runs its own exec, on the regexp)
      if (f !== this.f) {
        this.f = f;
        // Ours: its checks once (a source cannot change but through compile, which checks its
        // own), then the native exec at each match, whose result is an array of its own data.
        if (f === checkedExec) {
          checkPattern(t);
          this.exec = (s) => apply(nativeExec, t, [s]);
        } else {
          this.exec = (s) => {
            const r = apply(f, t, [s]);
            return !isObject(r) || (genuine(r) && r.length <= FEW) ? r : slow().execResult(r);
          };
        }
      }
      return this.exec;
    }
    if (k !== "constructor") return reflectGet(t, k, t);
    // Split's SpeciesConstructor. The splitter it makes is seen through a facade too, unless it is
    // the sandbox's own RegExp's and finds the native exec: no guest code runs in split's loop then
    // (its limit was made a number before the native ran: see RP[SPLIT]), so its exec stays ours.
    const C = reflectGet(t, k, t);
    let S = GuardedRegExp;
    if (C !== undefined) {
      if (!isObject(C)) throw new TypeError("RegExp.prototype[Symbol.split]: the regexp's constructor is not an object");
      const species = C[SPECIES];
      if (species != null) S = species;
    }
    return {__proto__: null, [SPECIES]: apply(nBind, splitter, [null, t, S])};
  }};
  // (bound, a constructor with no prototype object of its own to make at each split)
  const nBind = NativeFunction.prototype.bind;
  // ("finds the native exec": as data, RegExp.prototype's own, not a getter: one that gave ours to
  // this check and the guest's to the native ran 5.2 s.)
  const hasOwn = Object.hasOwn;
  const splitter = function (t, S, _, flags) {
    const r = nativeConstruct(S, [t, flags]);
    if (S !== GuardedRegExp || getProto(r) !== RP || hasOwn(r, "exec")) return facade(r);
    const d = getOwnDescriptor(RP, "exec");
    return d !== undefined && hasOwn(d, "value") && d.value === checkedExec ? r : facade(r);
  };
  RP[REPLACE] = new NativeProxy(rxReplace, {__proto__: null, apply(native, self, args) {
    if (!isObject(self)) return apply(native, self, args);
    const r = args.length > 1 ? args[1] : undefined;
    if (typeof r === "function") return apply(native, facade(self), args);
    const s = text(args.length > 0 ? args[0] : undefined), t = text(r);
    return apply(native, facade(self), [s, heavy(s.length, t, true) ? slow().template(t) : t]);
  }});
  // (A limit that is an object is made a number first, before the regexp's flags are read.)
  RP[SPLIT] = new NativeProxy(RP[SPLIT], {__proto__: null, apply(native, self, args) {
    if (!isObject(self)) return apply(native, self, args);
    if (args.length > 1 && isObject(args[1])) args = [text(args[0]), args[1] >>> 0];
    return apply(native, facade(self), args);
  }});
  const sourceOf = Reflect.getOwnPropertyDescriptor(RP, "source").get;
  const checkPattern = (r) => {
    const n = apply(sourceOf, r, []).length;
    if (n > MAX_PATTERN)
      throw new RangeError("RegExp.prototype.exec on a pattern of " + n + " characters: the sandbox allows at most " +
                           MAX_PATTERN);
  };
  assign(RP, {
    exec(string) {
      checkPattern(this);
      return apply(nativeExec, this, [string]);
    },
  });
  const checkedExec = RP.exec;
  // Compiling a pattern is not polled either, and one of its steps is quadratic: each `\k<name>` before
  // its group scans the whole pattern (`new RegExp('\k<x>'.repeat(2e5) + '(?<x>a)')` ran 474 s at
  // 16 MiB; 10,000 of them 1 s). exec refuses a pattern over MAX_PATTERN anyway, so what compiles one
  // refuses it first: the constructor (a proxy of the native, as `constructor`, the global and its
  // species: a call, `new`, subclasses; split's copies), `compile`, and match, matchAll and search,
  // which make a regexp of a string. A regexp's own source was checked when it was made, unless it
  // is a literal (of the plugin's code, or an eval's: parsing is not polled either).
  const patternTooLong = (what, n) => new RangeError(what + " on a pattern of " + n + " characters: the sandbox " +
                                                     "allows at most " + MAX_PATTERN);
  const matcher = (v) => { try { apply(sourceOf, v, []); return v !== RP; } catch (_) { return false; } };
  // Each property escape (\p{..}, \P{..}) builds its Unicode set when the pattern compiles, and the
  // class operations and case folding work on those sets, all in C with no poll: a 16 KB pattern of
  // 1,170 `[\p{L}&&\p{L}]` compiled 0.35 s of CPU at 16 MiB, 1,200 `\p{RGI_Emoji}` 2.7 s at 256 MiB.
  // A pattern's escapes may weigh at most __PROPERTY_WORK__ (MAX_PROPERTY_WORK in js.py, which checks a
  // plugin's source the same way for its literals), a property of strings (RGI_Emoji..., Basic_Emoji:
  // 0.9-3.6 ms each) __HEAVY_PROPERTY__, any other 1 (at most ~0.24 ms): ~60 ms at most. Counted
  // natively, one indexOf per escape (polled between); a backslash-escaped backslash counts too.
  const PROPERTY_WORK = __PROPERTY_WORK__, HEAVY_PROPERTY = __HEAVY_PROPERTY__, ESCAPES = ["\\p{", "\\P{"];
  const propertyWork = (s, what) => {
    let work = 0;
    for (let e = 0; e < 2; e++) {
      for (let i = apply(sIndexOf, s, [ESCAPES[e], 0]); i !== -1; i = apply(sIndexOf, s, [ESCAPES[e], i + 3])) {
        const name = apply(sSlice, s, [i + 3, i + 14]);
        work += apply(sSlice, name, [0, 9]) === "RGI_Emoji" || name === "Basic_Emoji" ? HEAVY_PROPERTY : 1;
        if (work > PROPERTY_WORK)
          throw new RangeError(what + " on a pattern whose property escapes (\\p{...}) weigh more than " +
                               PROPERTY_WORK + " (MAX_PROPERTY_WORK: each counts 1, a property of strings such as " +
                               "RGI_Emoji " + HEAVY_PROPERTY + "): the sandbox allows at most that; use fewer");
      }
    }
  };
  const checked = (s, what) => {
    if (s.length > MAX_PATTERN) throw patternTooLong(what, s.length);
    propertyWork(s, what);
  };
  // The pattern the native compiles, checked: a string, or what an object makes of it (slow().pattern).
  const pattern = (args, what) => {
    const p = args.length > 0 ? args[0] : undefined;
    if (typeof p === "string") {
      checked(p, what);
      return args;
    }
    if (p === null || (typeof p !== "object" && typeof p !== "function")) return args;  // (its text is short)
    if (matcher(p)) {  // a regexp: compiled from its source (the native reads its slot, not a getter)
      checked(apply(sourceOf, p, []), what);
      return args;
    }
    const pf = slow().pattern(p, args.length > 1 ? args[1] : undefined, isRegExp);
    checked(pf[0], what);
    return pf;
  };
  const GuardedRegExp = new NativeProxy(NativeRegExp, {__proto__: null,
    construct: (N, args, nt) => nativeConstruct(N, pattern(args, "new RegExp"), nt),
    apply(N, self, args) {
      // (called without new, the native hands back a regexp whose constructor is RegExp itself)
      const p = args.length > 0 ? args[0] : undefined;
      if ((args.length < 2 || args[1] === undefined) && isRegExp(p) && p.constructor === GuardedRegExp) return p;
      return apply(N, self, pattern(args, "RegExp"));
    }});
  RP.constructor = GuardedRegExp;
  g.RegExp = GuardedRegExp;
  const nCompile = RP.compile;
  if (typeof nCompile === "function") {
    assign(RP, {compile(p, flags) {
      if (!matcher(this)) return apply(nCompile, this, [p, flags]);  // (its TypeError first)
      if (p !== null && typeof p === "object" && !matcher(p)) p = text(p);
      return apply(nCompile, this, [pattern([p], "RegExp.prototype.compile")[0], flags]);
    }});
  }
  // Each a proxy of the native (see arrayTraps) with one apply trap. (A getter for the symbol may run
  // once more.)
  const makers = ["match", "matchAll", "search"], makerSymbols = [MATCH, Symbol.matchAll, Symbol.search],
        makerNatives = [SP.match, SP.matchAll, SP.search];
  proxied(SP, makers, {__proto__: null, apply(native, self, args) {
    const i = native === makerNatives[0] ? 0 : native === makerNatives[1] ? 1 : 2;
    let r = args.length > 0 ? args[0] : undefined;
    if (r !== null && (typeof r === "object" || typeof r === "function")) {
      if (r[makerSymbols[i]] != null) return apply(native, self, args);
      r = text(r);
    }
    return apply(native, self, [typeof r === "string" ? pattern([r], "String.prototype." + makers[i])[0] : r]);
  }});

  // -- Two more walks over a length: a replacer array's (JSON.stringify) and String.raw's `raw`.
  // JSON.parse makes each new key an atom: QuickJS's atom table is a hash table with a fixed hash
  // (h * 263 + c), and each new atom walks its whole bucket in C. Keys made to share one hash (two
  // characters, a and 263 * (248 - a), hash alike) turned a 240 KB text of 20,000 keys into 1.07 s
  // of one native call at 16 MiB (60,000 keys: 11 s). A text past PARSE_SCAN characters has its
  // keys' hashes counted in bytecode first (slow().keys) and is refused past COLLIDING of one hash.
  // A text with at most FEW_KEYS colons has at most that many keys: however they collide, tens of
  // ms of bucket walks (4,096 keys of one hash: ~45 ms), so it is not scanned (the scan cost a
  // 385 KB text of 10,000 keys ~80 ms against ~5 ms for the parse). Colons are counted natively,
  // one indexOf per colon (polled between), up to FEW_KEYS + 1.
  const PARSE_SCAN = 1 << 14, FEW_KEYS = 4096;
  const fewKeys = (s) => {
    let n = 0;
    for (let i = apply(sIndexOf, s, [":", 0]); i !== -1; i = apply(sIndexOf, s, [":", i + 1]))
      if (++n > FEW_KEYS) return false;
    return true;
  };
  assign(JSON, {
    parse(source, reviver) {
      const s = text(source);
      if (s.length > PARSE_SCAN && !fewKeys(s)) slow().keys(s);
      return apply(parse, JSON, [s, reviver]);
    },
    stringify(value, replacer, space) {
      return apply(stringify, JSON, [value, isArray(replacer) ? slow().replacer(replacer) : replacer, space]);
    },
  });
  assign(String, {raw(template, ...subs) { return slow().raw(template, subs); }});
