;; A WebAssembly busy loop (stopped by wasmtime epochs).
(module
  (memory (export "memory") 1)
  (func (export "alloc") (param $len i32) (result i32) (i32.const 1024))
  (func (export "f") (param $ptr i32) (param $len i32) (result i64)
    (loop $forever (br $forever))
    (i64.const 0)))
