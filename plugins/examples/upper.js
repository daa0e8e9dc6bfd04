// upper: /upper <text> -> <text> upper-cased
function upper(event) {
  return event.args.toUpperCase();
}
