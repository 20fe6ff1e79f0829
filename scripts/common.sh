# Shared by the five launchers (sourced, not run): maps the launcher variables to the CLI
# flags of `python -m train`, one name per knob (the README's table), and starts the run.
# SHOW_COMMAND=1 prints the command instead of running it. NPROC_PER_NODE > 1 (or NNODES > 1)
# starts the run through torchrun (see kit_torchrun), one process per GPU.

KIT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

kit_fail() {
  echo "error: $*" >&2
  exit 2
}

# kit_knobs: KIT_VALUE_KNOBS (variable:--flag for every knob that takes a value; empty means "not
# set": the preset or the dataclass default applies) and KIT_SWITCH_KNOBS (the guides' switch
# form: the flag itself, or 1/0, or empty), both read from config.py's fields and their markers,
# so a knob added there is a variable here too; KIT_MODE_KNOBS (variable:mode,mode for a knob some
# mode does not read: its knob(modes=...)) and KIT_MODE_NAMES (mode=its name, for the refusal).
# One Python start (-I -S: no site-packages, about 0.1 s), with the interpreter the run itself will
# use where the kit has one.
kit_knobs() {
  local py=python3 out
  if [ -x "$KIT_DIR/.venv/bin/python" ]; then py="$KIT_DIR/.venv/bin/python"; fi
  command -v "$py" >/dev/null 2>&1 || kit_fail "no python3 found: run 'make setup' in $KIT_DIR first"
  # An edit that breaks config.py is one line (the file and line), exit code 2.
  out=$("$py" -I -S -c 'import sys; sys.path.insert(0, sys.argv[1])
try:
    from train.config.knobs import print_launcher_lists
except Exception as err:
    sys.exit(f"error: config.py cannot be read: {type(err).__name__}: {err}")
print_launcher_lists()' "$KIT_DIR") || exit 2
  { read -ra KIT_VALUE_KNOBS && read -ra KIT_SWITCH_KNOBS && read -ra KIT_MODE_KNOBS \
    && IFS='|' read -ra KIT_MODE_NAMES; } <<<"$out" || kit_fail "config.py: no knob lists read"
}
kit_knobs

# The other variables the kit reads: multi-process runs (kit_torchrun; RANK, LOCAL_RANK and
# WORLD_SIZE are torchrun's), scripts/bench.sh, scripts/compare.sh, scripts/setup.sh, the Makefile.
KIT_OTHER_VARIABLES=(
  NPROC_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT SHOW_COMMAND RANK LOCAL_RANK WORLD_SIZE
  PRESET ROUNDS THREADS VS_PLAIN COMPARE_SAMPLES REPEAT PYTHON TORCH_INDEX_URL MODEL ARGS
  KIT_NAMES_CHECKED KIT_NAME_WARNINGS GPU_REPORT_BUDGET_S GPU_REPORT_DIR GPU_REPORT_PARTS GPU_REPORT_PEER_SITE
  GPU_REPORT_DRY
  KIT_MADE_BY KIT_PYTHON
)

kit_python() {
  if [ -n "${KIT_PYTHON:-}" ]; then
    [ -x "$KIT_PYTHON" ] || kit_fail "KIT_PYTHON: '$KIT_PYTHON' is not an executable Python"
    echo "$KIT_PYTHON"
  elif [ -x "$KIT_DIR/.venv/bin/python" ]; then
    echo "$KIT_DIR/.venv/bin/python"
  elif python3 -c "import torch, transformers" >/dev/null 2>&1; then
    echo python3
  else
    kit_fail "no Python environment with torch and transformers: run 'make setup' in $KIT_DIR first"
  fi
}

# kit_check_names: a warning for every environment variable that looks like a misspelled
# variable of the kit (BACH_SIZE=8 would otherwise be ignored without a word). Close means: one
# edit away (a swap of neighbours is one edit); two for names over 5 letters that start with
# the same letter; the same letters in another order; or a knob's flag written as a variable
# (GRADIENT_ACCUMULATION_STEPS). A warning only: the run goes on. Once per command: scripts
# that run the launchers (make compare) check for them.
kit_check_names() {
  [ -z "${KIT_NAMES_CHECKED:-}" ] || return 0
  export KIT_NAMES_CHECKED=1
  command -v python3 >/dev/null 2>&1 || return 0
  local warnings
  warnings=$(python3 -I -S - "${KIT_VALUE_KNOBS[@]}" "${KIT_SWITCH_KNOBS[@]}" "${KIT_OTHER_VARIABLES[@]}" 2>&1 <<'PY' || true
import os, re, sys

known, flag_forms = set(), {}
for item in sys.argv[1:]:
    name, _, flag = item.partition(":")
    known.add(name)
    if flag:
        flag_forms[flag.lstrip("-").upper()] = name
# Names every shell has, a letter or two from a short knob (LANG and RANK, USER and SEED ...).
common = {"PATH", "HOME", "USER", "LANG", "TERM", "SHELL", "PWD", "OLDPWD", "MAIL", "MODE", "TZ", "DISPLAY",
          "EDITOR", "PAGER", "HOST", "HOSTNAME", "LOGNAME", "LINES", "COLUMNS", "TMPDIR", "SHLVL", "ROLE_RANK",
          "GROUP_RANK", "LOCAL_WORLD_SIZE"}


def distance(a, b, limit):
    """Edits from a to b (insert, delete, replace, swap of neighbours); limit + 1 when more."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    before, row = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            cost = min(row[j] + 1, current[j - 1] + 1, row[j - 1] + (ca != cb))
            if before is not None and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        if min(current) > limit:
            return limit + 1
        before, row = row, current
    return row[-1]


for name in sorted(os.environ):
    if name in known or name in common or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
        continue
    limit = 1 if len(name) <= 5 else 2
    guess = flag_forms.get(name)
    if guess is None:
        scored = sorted((distance(name, k, limit), k) for k in known)
        # Two edits and another first letter is more often another tool's name (NODE_PATH).
        if scored[0][0] <= min(limit, 1) or (scored[0][0] <= limit and scored[0][1][0] == name[0]):
            guess = scored[0][1]
    if guess is None and len(name) >= 5:
        guess = next((k for k in sorted(known) if sorted(k) == sorted(name)), None)
    if guess is not None:
        print(f"warning: {name} is not a variable of this kit; did you mean {guess}?", file=sys.stderr)
PY
)
  [ -n "$warnings" ] || return 0
  echo "$warnings" >&2
  # the first line scrolls away in a long run: the run repeats them in its closing lines
  export KIT_NAME_WARNINGS="$warnings"
}

# kit_unread MODE VARIABLE: true when MODE is a training mode that does not read VARIABLE's knob.
kit_unread() {
  local entry
  for entry in "${KIT_MODE_KNOBS[@]}"; do
    if [ "${entry%%:*}" = "$2" ]; then
      [[ ",${entry#*:}," != *",$1,"* ]] && [[ " ${KIT_MODE_NAMES[*]} " == *" $1="* ]]
      return
    fi
  done
  return 1
}

# kit_refuse_unread MODE VARIABLE: a variable its mode does not read, set by the user: one line, exit 2
# (python -m train refuses the flag too; here the line names the launcher). One the launcher's own
# default set (after KIT_GIVEN was taken) is no user's: it is left out instead.
kit_refuse_unread() {
  local mode=$1 var=$2 entry name readers=() list
  [ -n "${KIT_GIVEN+x}" ] && [[ $KIT_GIVEN != *" $var "* ]] && return 1
  for entry in "${KIT_MODE_KNOBS[@]}"; do
    [ "${entry%%:*}" = "$var" ] && list=",${entry#*:},"
  done
  for entry in "${KIT_MODE_NAMES[@]}"; do
    [ "${entry%%=*}" = "$mode" ] && name=${entry#*=}
    [[ $list == *",${entry%%=*},"* ]] && readers+=("${entry#*=}")
  done
  list=$(printf '%s, ' "${readers[@]:0:${#readers[@]}-1}")
  list=${list%, }
  kit_fail "$var does not apply to $name ($(basename "$0")): it is read by" \
    "${list:+$list and }${readers[-1]} only; leave it empty"
}

# kit_launch MODE PRESET [extra flags...]: build the flag list from the variables and run.
kit_launch() {
  local mode=$1 preset=$2 pair var flag value
  shift 2
  local args=(-m train "$mode" --preset "$preset" --launcher "${KIT_MADE_BY:+$KIT_MADE_BY-}$(basename "$0" .sh)")
  # RESUME=1 continues a run with its own settings (train/run/guard/carry.py): only the variables the
  # user set (KIT_GIVEN, recorded by the launcher's knob block before its defaults) are passed, so a
  # launcher's `BATCH_SIZE=${BATCH_SIZE:-8}` does not replace the run's micro-batch. Without a knob
  # block (scripts/kit.sh) every variable set is the user's.
  local resuming=0
  case "${RESUME:-}" in 1 | [Tt][Rr][Uu][Ee] | [Yy][Ee][Ss] | [Oo][Nn]) [ -z "${KIT_GIVEN+x}" ] || resuming=1 ;; esac
  for pair in "${KIT_VALUE_KNOBS[@]}"; do
    var=${pair%%:*} flag=${pair#*:}
    value=${!var:-}
    if [ "$resuming" = 1 ] && [[ $KIT_GIVEN != *" $var "* ]]; then value=""; fi
    if [ -n "$value" ] && kit_unread "$mode" "$var"; then kit_refuse_unread "$mode" "$var" || value=""; fi
    if [ -n "$value" ]; then args+=("$flag" "$value"); fi
  done
  for pair in "${KIT_SWITCH_KNOBS[@]}"; do
    var=${pair%%:*} flag=${pair#*:}
    value=${!var:-}
    if [ "$resuming" = 1 ] && [[ $KIT_GIVEN != *" $var "* ]]; then value=""; fi
    if [ -n "$value" ] && kit_unread "$mode" "$var"; then kit_refuse_unread "$mode" "$var" || value=""; fi
    case "${value,,}" in
      "" | 0 | false | no | off) ;;
      1 | true | yes | on | "$flag") args+=("$flag") ;;
      *) kit_fail "$var must be \"$flag\", 1 or 0 (or empty), got '$value'" ;;
    esac
  done
  args+=("$@")
  local runner=() python
  kit_torchrun runner
  python=$(kit_python)
  if [ ${#runner[@]} -gt 0 ] && [ -n "${KIT_PYTHON:-}" ]; then
    # KIT_PYTHON runs the ranks too: torchrun starts it as their program (its own interpreter otherwise)
    args=(--no-python "$python" -u "${args[@]}")
  fi
  if [ "${SHOW_COMMAND:-0}" = 1 ]; then
    # The interpreter the run really uses (.venv's, by its path): a bare `python` outside the
    # activated .venv has no torch. Run it from the kit's folder, where `-m train` is found.
    printf '%q ' "$python" "${runner[@]}" "${args[@]}"
    echo
    return 0
  fi
  PYTHONPATH="$KIT_DIR${PYTHONPATH:+:$PYTHONPATH}" exec "$python" "${runner[@]}" "${args[@]}"
}

# kit_torchrun ARRAY: the torchrun arguments for NPROC_PER_NODE / NNODES / NODE_RANK /
# MASTER_ADDR / MASTER_PORT (none for one process). torchrun in module form (no PATH lookup),
# through train/distributed/torchrun.py so that bad input still ends in one line and exit code 2.
# The trainer itself reads only RANK, LOCAL_RANK and WORLD_SIZE, which torchrun sets.
kit_torchrun() {
  local -n out=$1
  local nproc=${NPROC_PER_NODE:-1} nnodes=${NNODES:-1} var
  for var in NPROC_PER_NODE NNODES; do
    [[ ${!var:-1} =~ ^[1-9][0-9]*$ ]] || kit_fail "$var: expected a whole number >= 1, got '${!var}'"
  done
  [[ ${NODE_RANK:-0} =~ ^[0-9]+$ ]] || kit_fail "NODE_RANK: expected a whole number >= 0, got '$NODE_RANK'"
  [[ ${MASTER_PORT:-1} =~ ^[1-9][0-9]*$ ]] || kit_fail "MASTER_PORT: expected a port number, got '$MASTER_PORT'"
  out=()
  if [ "$nproc" = 1 ] && [ "$nnodes" = 1 ]; then
    return 0
  fi
  out=(-m train.distributed.torchrun --nproc_per_node "$nproc" --nnodes "$nnodes")
  if [ "$nnodes" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
    kit_fail "NNODES=$nnodes: set MASTER_ADDR to the address of the first machine (and the same MASTER_PORT on every machine)"
  fi
  if [ -n "${NODE_RANK:-}" ]; then
    # fixed ranks, the guides' form: every machine says which one it is
    out+=(--node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}")
  elif [ "$nnodes" -gt 1 ] || [ -n "${MASTER_PORT:-}" ]; then
    # c10d rendezvous: machines join in any order at MASTER_ADDR:MASTER_PORT
    out+=(--rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" --rdzv_id "${RUN_NAME:-gpu-train-kit}")
  else
    out+=(--standalone)  # one machine: c10d rendezvous on a free local port
  fi
}

kit_check_names
