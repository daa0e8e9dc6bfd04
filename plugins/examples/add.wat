;; add: /add <a> <b> -> the integer sum (WASM example; the ABI is in docs/plugins.md).
;; The host writes the event JSON at the pointer alloc() returns; the ABI puts the "args"
;; key first, so the arguments start 9 bytes in ({"args":"), no JSON parser needed.
(module
  (memory (export "memory") 1)
  (global $pos (mut i32) (i32.const 0))
  (global $end (mut i32) (i32.const 0))
  (global $ok (mut i32) (i32.const 0))
  (data (i32.const 256) "usage: /add <a> <b> (two integers)")

  ;; One input buffer at 1024, grown as needed: every call reuses it (bump allocator).
  (func (export "alloc") (param $len i32) (result i32)
    (local $need i32)
    (local.set $need (i32.add (i32.const 1024) (local.get $len)))
    (if (i32.gt_u (local.get $need) (i32.mul (memory.size) (i32.const 65536)))
      (then
        (if (i32.eq
              (memory.grow (i32.sub (i32.div_u (i32.add (local.get $need) (i32.const 65535)) (i32.const 65536))
                                    (memory.size)))
              (i32.const -1))
          (then (return (i32.const 0))))))
    (i32.const 1024))

  (func $peek (result i32)
    (if (result i32) (i32.lt_u (global.get $pos) (global.get $end))
      (then (i32.load8_u (global.get $pos)))
      (else (i32.const -1))))

  (func $is_digit (param $c i32) (result i32)
    (i32.and (i32.ge_s (local.get $c) (i32.const 48)) (i32.le_s (local.get $c) (i32.const 57))))

  (func $skip_spaces
    (block $done
      (loop $next
        (br_if $done (i32.ne (call $peek) (i32.const 32)))
        (global.set $pos (i32.add (global.get $pos) (i32.const 1)))
        (br $next))))

  ;; An optional '-' and 1..18 digits; sets $ok.
  (func $int (result i64)
    (local $neg i32) (local $n i64) (local $digits i32)
    (if (i32.eq (call $peek) (i32.const 45))
      (then (local.set $neg (i32.const 1))
            (global.set $pos (i32.add (global.get $pos) (i32.const 1)))))
    (block $done
      (loop $next
        (br_if $done (i32.eqz (call $is_digit (call $peek))))
        (br_if $done (i32.ge_u (local.get $digits) (i32.const 18)))
        (local.set $n (i64.add (i64.mul (local.get $n) (i64.const 10))
                               (i64.extend_i32_u (i32.sub (call $peek) (i32.const 48)))))
        (local.set $digits (i32.add (local.get $digits) (i32.const 1)))
        (global.set $pos (i32.add (global.get $pos) (i32.const 1)))
        (br $next)))
    (global.set $ok (i32.and (i32.gt_u (local.get $digits) (i32.const 0))
                             (i32.eqz (call $is_digit (call $peek)))))
    (if (result i64) (local.get $neg)
      (then (i64.sub (i64.const 0) (local.get $n)))
      (else (local.get $n))))

  (func $pack (param $p i32) (param $n i32) (result i64)
    (i64.or (i64.shl (i64.extend_i32_u (local.get $p)) (i64.const 32)) (i64.extend_i32_u (local.get $n))))

  (func $usage (result i64)
    (call $pack (i32.const 256) (i32.const 34)))

  (func (export "add") (param $ptr i32) (param $len i32) (result i64)
    (local $a i64) (local $b i64) (local $sum i64) (local $p i32) (local $neg i32)
    (global.set $pos (i32.add (local.get $ptr) (i32.const 9)))
    (global.set $end (i32.add (local.get $ptr) (local.get $len)))
    (call $skip_spaces)
    (local.set $a (call $int))
    (if (i32.eqz (global.get $ok)) (then (return (call $usage))))
    (call $skip_spaces)
    (local.set $b (call $int))
    (if (i32.eqz (global.get $ok)) (then (return (call $usage))))
    (call $skip_spaces)
    ;; the closing quote of "args"
    (if (i32.ne (call $peek) (i32.const 34)) (then (return (call $usage))))
    (local.set $sum (i64.add (local.get $a) (local.get $b)))
    (if (i64.lt_s (local.get $sum) (i64.const 0))
      (then (local.set $neg (i32.const 1))
            (local.set $sum (i64.sub (i64.const 0) (local.get $sum)))))
    ;; digits written backwards, ending at 240
    (local.set $p (i32.const 240))
    (loop $digit
      (local.set $p (i32.sub (local.get $p) (i32.const 1)))
      (i64.store8 (local.get $p) (i64.add (i64.const 48) (i64.rem_u (local.get $sum) (i64.const 10))))
      (local.set $sum (i64.div_u (local.get $sum) (i64.const 10)))
      (br_if $digit (i64.ne (local.get $sum) (i64.const 0))))
    (if (local.get $neg)
      (then (local.set $p (i32.sub (local.get $p) (i32.const 1)))
            (i32.store8 (local.get $p) (i32.const 45))))
    (call $pack (local.get $p) (i32.sub (i32.const 240) (local.get $p)))))
