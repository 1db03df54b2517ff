# Sourced by scripts/setup.sh and scripts/setup_reference.sh: find_python WHY prints the first of $PYTHON,
# python3.11, python3 that is Python 3.11 (the project's torch wheel and megatron-core need it), else prints an
# error naming WHY and the PYTHON override and returns 1.
find_python() {
  for cand in "${PYTHON:-}" python3.11 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
      echo "$cand"; return 0
    fi
  done
  echo "error: $1 needs Python 3.11; set PYTHON=/path/to/python3.11" >&2
  return 1
}
