#!/usr/bin/env bash
# The mutation score of the training core (issue 34; the table is in docs/testing.md): mutmut (pinned in
# requirements.txt) mutates one file at a time and runs that file's fast unit tests against each mutant; a mutant
# those tests fail on is killed, one they pass on survived.
#
# Run by hand, never in CI: it is CPU-heavy (each file's tests run once per mutant they cover; 10-40 minutes a
# file on 2 cores). Each file is mutated in a copy of the repository under a temporary directory (mutmut writes its
# mutants/ there), kept when KEEP=1 for `mutmut results` / `mutmut show <mutant>` in it.
#
# Usage:  bash tests/mutation.sh [FILE ...]      default: the five files below; CHILDREN=2 parallel test processes
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MUTMUT="$REPO/.venv/bin/mutmut"
CHILDREN=${CHILDREN:-2}
# the copy under /tmp has no ../shared beside it: point the tests at this checkout's mirror of MiniMind's tokenizers,
# or the tests that need them skip and their mutants look untested (tests/conftest.py)
if [ -z "${MINIMIND_SHARED:-}" ] && [ -d "$REPO/../shared/minimind" ]; then
    export MINIMIND_SHARED="$(cd "$REPO/../shared/minimind" && pwd)"
fi
declare -A TESTS=(  # each file's fast unit tests (no Ray): the runner of its mutants
  [minimind_ray/engine/step.py]="tests/unit/test_train_step.py tests/unit/test_engine.py tests/unit/test_objectives.py tests/unit/test_grpo.py tests/unit/test_ppo.py"
  [minimind_ray/rl/grpo.py]="tests/unit/test_grpo.py tests/unit/test_grpo_options.py tests/unit/test_rl_learns.py"
  [minimind_ray/rl/ppo.py]="tests/unit/test_ppo.py tests/unit/test_rl_learns.py"
  [minimind_ray/data/stream.py]="tests/unit/test_stream.py tests/unit/test_engine.py tests/unit/test_formats.py"
  [minimind_ray/store/checkpoint.py]="tests/unit/test_checkpoint.py tests/unit/test_resume.py tests/unit/test_engine.py"
)
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(minimind_ray/engine/step.py minimind_ray/rl/grpo.py minimind_ray/rl/ppo.py
                                 minimind_ray/data/stream.py minimind_ray/store/checkpoint.py)
printf '%-34s %8s %7s %9s %8s %6s\n' file mutants killed survived "no test" score
for file in "${FILES[@]}"; do
    tests=${TESTS[$file]:?"no tests listed for $file in tests/mutation.sh"}
    work=$(mktemp -d "/tmp/mutation-$(basename "$file" .py)-XXXX")
    cp -r minimind_ray pipelines tests pyproject.toml "$work/"
    for t in $tests; do [ -e "$work/$t" ] || { echo "$t: no such test file" >&2; exit 2; }; done
    {
        echo "[mutmut]"
        echo "source_paths=minimind_ray"
        echo "also_copy="
        echo "    pipelines"   # the recipes some tests load
        echo "only_mutate=$file"
        echo "pytest_add_cli_args_test_selection="
        for t in $tests; do echo "    $t"; done
        echo "pytest_add_cli_args="
        echo "    -p"
        echo "    no:cacheprovider"
        echo "    -x"
        echo "process_isolation=forkserver"   # torch is not fork-safe once its threads have started
    } > "$work/setup.cfg"
    (cd "$work" && OMP_NUM_THREADS=1 "$MUTMUT" run --max-children "$CHILDREN" > mutmut-run.log 2>&1) || true
    (cd "$work" && "$MUTMUT" results --all true > results.txt 2>&1) || true
    total=$(grep -c ": " "$work/results.txt" || true)
    killed=$(grep -cE ": (killed|timeout)$" "$work/results.txt" || true)  # a mutant that hangs the tests is caught
    survived=$(grep -c ": survived$" "$work/results.txt" || true)
    other=$((total - killed - survived))
    score=$(awk -v k="$killed" -v t="$total" 'BEGIN { printf (t ? "%.1f%%" : "-"), 100 * k / (t ? t : 1) }')
    printf '%-34s %8d %7d %9d %8d %6s\n' "$file" "$total" "$killed" "$survived" "$other" "$score"
    grep -vE ": (killed|timeout)$" "$work/results.txt" | sed "s|^|    |" || true
    if [ "${KEEP:-0}" = 1 ]; then echo "    kept: $work"; else rm -rf "$work"; fi
done
