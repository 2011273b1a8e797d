#!/usr/bin/env bash
# memfit/memory/ into its three parts (#38): techniques (applied to a model or a step; from training/ too),
# estimator (measuring and estimating a step), planner (choosing the stack). Arrows one way: the estimator
# and the trainer use the techniques; the planner uses the estimator.
#
# Pure moves (git mv) and rewrites of the moved modules' names (dotted, paths, `from package import module`)
# in every tracked text file; nothing else changes. Idempotent: run it again after merging a branch that
# still says the old names, and it moves what is left and rewrites what is new. Exit 1 if an import is left
# that it cannot rewrite alone (one `from ... import` naming modules of two groups).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

declare -A GROUP=(
  [policies]=techniques [activation_offload]=techniques [lean_layers]=techniques
  [tracker]=estimator [timeline]=estimator [breakdown]=estimator [charts]=estimator [step]=estimator
  [probe]=estimator [estimate]=estimator [compose]=estimator [preference]=estimator [evaluation]=estimator
  [search]=planner [candidates]=planner [plan]=planner [plan_cache]=planner [limits]=planner
  [sharding]=planner [monitor]=planner [replan]=planner [pair_length]=planner
)
FROM_TRAINING=(loss optim schedule fused_loss offload_optim)  # the loss and optimizer variants (and the LR schedule optim steps)
declare -A DOC=(
  [techniques]="What is applied to a model or a step: checkpointing, offload, lean layers, loss and optimizer variants."
  [estimator]="Measuring and estimating a step's memory: tracker, the step on real or fake tensors, composition, timelines."
  [planner]="Choosing the stack that fits: candidates, search over estimates, the plan and its cache, limits, the watch."
)

for g in techniques estimator planner; do
  mkdir -p "memfit/memory/$g"
  if [ ! -f "memfit/memory/$g/__init__.py" ]; then
    printf '"""%s"""\n' "${DOC[$g]}" > "memfit/memory/$g/__init__.py"
    git add "memfit/memory/$g/__init__.py"
  fi
done

move() {  # src dst: once; a second run finds src gone
  if [ -f "$1" ] && [ ! -f "$2" ]; then git mv "$1" "$2"; fi
  if [ -f "$1" ] && [ -f "$2" ]; then echo "both $1 and $2 exist: merge them by hand" >&2; exit 1; fi
}
for m in "${!GROUP[@]}"; do move "memfit/memory/$m.py" "memfit/memory/${GROUP[$m]}/$m.py"; done
for m in "${FROM_TRAINING[@]}"; do move "memfit/training/$m.py" "memfit/memory/techniques/$m.py"; done

expr=()
for m in "${!GROUP[@]}"; do
  g=${GROUP[$m]}
  expr+=(-e "s#memfit\\.memory\\.$m\\b#memfit.memory.$g.$m#g"
         -e "s#memfit/memory/$m\\.py#memfit/memory/$g/$m.py#g"
         -e "s#from memfit\\.memory import $m\$#from memfit.memory.$g import $m#"
         -e "s#(^|[^/[:alnum:]_.])memory/$m\\.py#\\1$g/$m.py#g")  # a comment's memory/x.py: short, lines keep their width
done
t='(loss|optim|schedule|fused_loss|offload_optim)'
for m in "${FROM_TRAINING[@]}"; do
  expr+=(-e "s#memfit\\.training\\.$m\\b#memfit.memory.techniques.$m#g"
         -e "s#memfit/training/$m\\.py#memfit/memory/techniques/$m.py#g"
         -e "s#(^|[^/[:alnum:]_.])training/$m\\.py#\\1techniques/$m.py#g")
done
expr+=(-e "s#from memfit\\.training import ($t(, $t)*)\$#from memfit.memory.techniques import \\1#")

mapfile -t files < <(git ls-files -- '*.py' '*.md' '*.sh' '*.toml' '*.yaml' '*.yml' '*.txt' '*.cfg' Makefile \
                     | grep -v '^tools/split_memory\.sh$')
sed -i -E "${expr[@]}" "${files[@]}"  # extended regexes, all of them

# The plan cache hashes memfit's own code: its module is one folder deeper now.
sed -i 's#^_PACKAGE = Path(__file__).resolve().parents\[1\]  \# memfit/#_PACKAGE = Path(__file__).resolve().parents[2]  \# memfit/#' \
  memfit/memory/planner/plan_cache.py

# Import blocks sorted again (a moved module sorts elsewhere, two lines from one package merge); nothing else.
ruff=${RUFF:-$(command -v ruff || echo .venv/bin/ruff)}
if command -v "$ruff" >/dev/null 2>&1; then
  "$ruff" check --select I --fix --quiet memfit flows tasks tests bench tools || true
else
  echo "ruff not found (set RUFF=path/to/ruff): import blocks left unsorted" >&2
fi

left=$(git grep -nE "from memfit\\.memory import |from memfit\\.training import .*\\b$t\\b" -- '*.py' || true)
if [ -n "$left" ]; then
  echo "imports to split by hand (they name modules of more than one group):" >&2
  echo "$left" >&2
  exit 1
fi
echo "memory/ split: $(git status --short | wc -l) paths changed"
