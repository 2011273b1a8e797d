"""The docs name no stale config key or file: README.md and docs/*.md checked against the tree and the repo.

Only code is read (`inline spans` and fenced blocks), never prose: a dotted token counts as a config key when
it starts with a top-level section of `MemfitConfig` (`checkpoint.every_steps`, `--set a.b=1`,
`train.{lr,seed}`), a token counts as a path when it starts with a folder of the repository (`memfit/...`,
`configs/...`) or is one of its top-level files. Also: README.md is at most 250 lines, links every docs page,
every relative link and anchor resolves, the Layout block lists exactly the modules of memfit/, and
docs/configuration.md lists every key. Reads files only; starts no process.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from memfit.config import MemfitConfig

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 250

# Folders whose paths the docs name; other first parts (runs/, incoming/, exported/) are outputs of a run.
FOLDERS = ("memfit", "flows", "tasks", "tests", "configs", "infra", "bench", "docs", ".ci")
TOP_FILES = ("Makefile", "pyproject.toml", "constraints.txt", "prefect.yaml", "docker-compose.yml",
             ".env.example", "README.md", ".gitignore", ".dockerignore")
# A dotted token ending in one of these is a file name (`model.onnx`), not a key.
FILE_SUFFIXES = {"py", "md", "json", "yaml", "yml", "onnx", "png", "txt", "jsonl", "html", "pickle", "db",
                 "sql", "toml", "csv", "safetensors", "pt"}
# MLflow params that describe the data, logged beside the flattened config (memfit/run_context.py).
NOT_CONFIG_KEYS = {"data.digest", "data.train_blocks", "data.val_blocks", "data.source", "data.layout"}


def _is_section(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def config_keys(model: type[BaseModel] = MemfitConfig, prefix: str = "") -> set[str]:
    """Every dotted key of the tree: leaves and the sections holding them (`eval.gate`, `checkpoint.spot`)."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        key = prefix + name
        keys.add(key)
        if _is_section(field.annotation):
            keys |= config_keys(field.annotation, key + ".")
    return keys


def leaf_keys(model: type[BaseModel] = MemfitConfig, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            out |= leaf_keys(field.annotation, prefix + name + ".")
        else:
            out.add(prefix + name)
    return out


KEYS = config_keys()
SECTIONS = sorted(MemfitConfig.model_fields, key=len, reverse=True)
KEY_RE = re.compile(
    r"(?<![\w./\-])(?:" + "|".join(SECTIONS) + r")(?:\.(?:[A-Za-z_]\w*|\{[\w,]+\}))+(?![\w(\-]|\.[\w{])")
PATH_RE = re.compile(
    r"(?<![\w./\-])(?:(?:" + "|".join(re.escape(f) for f in FOLDERS) + r")/[\w./\-]*(?:\{[\w.,\-]+\}[\w./\-]*)*"
    r"|(?:" + "|".join(re.escape(f) for f in TOP_FILES) + r")(?![\w.\-/]))")
MODULE_RE = re.compile(r"-m ((?:memfit|flows|tasks)(?:\.\w+)+)")
FENCE_RE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN_RE = re.compile(r"`([^`]+)`")


def expand(token: str) -> list[str]:
    """`train.{lr,seed}` → train.lr, train.seed (the first brace group, then the rest recursively)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for part in m.group(1).split(",") for x in expand(token[:m.start()] + part + token[m.end():])]


def code_spans(text: str) -> list[tuple[int, str]]:
    """(line number, code) for every fenced block and every inline span outside them."""
    spans: list[tuple[int, str]] = []
    outside = list(text)
    for m in FENCE_RE.finditer(text):
        spans.append((text.count("\n", 0, m.start(1)) + 1, m.group(1)))
        outside[m.start():m.end()] = " " * (m.end() - m.start())
    rest = "".join(outside)
    for m in SPAN_RE.finditer(rest):
        spans.append((rest.count("\n", 0, m.start()) + 1, m.group(1)))
    return sorted(spans)


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Inside a folder .gitignore names (bench/out/): an output of a run, not a file of the repository."""
    parts = rel.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        sub = "/".join(parts[:i])
        for pat in patterns:
            p = pat.strip("/")
            if fnmatch.fnmatch(sub, p) or fnmatch.fnmatch(parts[i - 1], p):
                return True
    return False


def gitignore_patterns(repo: Path = REPO) -> list[str]:
    path = repo / ".gitignore"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith(("#", "!"))]


def stale_refs(page: str, text: str, keys: set[str] = KEYS, repo: Path = REPO) -> list[str]:
    """One line per config key, path or module the text names that does not exist: `page:line: what`."""
    ignored = gitignore_patterns(repo)
    problems: list[str] = []
    for line, code in code_spans(text):
        code_line = line
        for chunk in code.split("\n"):
            for m in KEY_RE.finditer(chunk):
                for key in expand(m.group(0)):
                    if key in keys or key in NOT_CONFIG_KEYS or key.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                        continue
                    problems.append(f"{page}:{code_line}: `{key}` is not a config key (memfit/config/__init__.py)")
            for m in PATH_RE.finditer(chunk):
                for rel in expand(m.group(0).rstrip(".")):
                    if _ignored(rel, ignored) or (repo / rel).exists():
                        continue
                    problems.append(f"{page}:{code_line}: `{rel}` does not exist in the repository")
            for m in MODULE_RE.finditer(chunk):
                rel = m.group(1).replace(".", "/")
                if not ((repo / f"{rel}.py").is_file() or (repo / rel / "__init__.py").is_file()):
                    problems.append(f"{page}:{code_line}: module `{m.group(1)}` does not exist")
            code_line += 1
    return problems


def anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose = FENCE_RE.sub("", text)
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose, re.M)}


def broken_links(page: Path, text: str) -> list[str]:
    problems = []
    prose = FENCE_RE.sub("", text)
    for m in re.finditer(r"\]\(([^)\s]+)\)", prose):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, frag = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        where = f"{page.relative_to(REPO)}: link ({target})"
        if not dest.exists():
            problems.append(f"{where}: {file} does not exist")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest.read_text()):
            problems.append(f"{where}: {dest.relative_to(REPO)} has no heading with anchor #{frag}")
    return problems


def layout_block(readme: str) -> str:
    m = re.search(r"^## Layout\n.*?^```\n(.*?)^```", readme, re.S | re.M)
    assert m, "README.md has no '## Layout' section with a code block"
    return m.group(1)


def layout_problems(block: str, repo: Path = REPO) -> list[str]:
    """The Layout block lists every module and package of memfit/ once, every top-level folder, nothing else."""
    problems: list[str] = []
    listed: dict[str, int] = {}
    top: set[str] = set()
    parent = ""
    chain: list[str] = []  # the folders (or "" for a module) the lines above sit in, below memfit/
    for raw in block.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        # A line names one entry, or several related modules joined by ", " (`a.py, b.py   what they do`).
        names = re.match(r"\s*((?:[\w.-]+/?, )*[\w.-]+/?)", raw).group(1).split(", ")
        name = names[0]
        if indent == 0:
            top.add(name.rstrip("/"))
            parent = name if name == "memfit/" else ""
            chain = []
            if name.endswith("/") and name != "memfit/":  # flows/  ... finetune.py, deploy.py ...: each exists
                problems += [f"README.md Layout: {name}{f} does not exist"
                             for f in re.findall(r"(?<![\w./-])([\w-]+\.(?:py|json|yaml))\b", raw)
                             if not (repo / name / f).exists()]
        elif parent and indent in (2, 4, 6) and all(chain[:indent // 2 - 1]) and len(chain) >= indent // 2 - 1:
            # Two spaces a level: memfit/x, memfit/sub/x, memfit/sub/part/x (deeper lines are wrapped descriptions).
            chain = chain[:indent // 2 - 1]
            for n in names:
                listed[parent + "".join(chain) + n] = listed.get(parent + "".join(chain) + n, 0) + 1
            chain.append(name if name.endswith("/") else "")
    actual = {p.relative_to(repo).as_posix() + ("/" if p.is_dir() else "")
              for p in (repo / "memfit").rglob("*")
              if (p.suffix == ".py" and p.name != "__init__.py" and "__pycache__" not in p.parts)
              or (p.is_dir() and (p / "__init__.py").is_file())}
    problems += [f"README.md Layout: {p} exists but is not listed" for p in sorted(actual - set(listed))]
    problems += [f"README.md Layout: lists {p}, which does not exist" for p in sorted(set(listed) - actual)]
    problems += [f"README.md Layout: lists {p} {n} times" for p, n in sorted(listed.items()) if n > 1]
    ignored = gitignore_patterns(repo)
    folders = {p.name for p in repo.iterdir() if p.is_dir() and p.name not in (".git",)
               and not _ignored(p.name + "/", ignored) and (not p.name.startswith(".") or p.name == ".ci")}
    problems += [f"README.md Layout: top-level folder {f}/ is not listed" for f in sorted(folders - top)]
    return problems


# -- the checks on the real docs ---------------------------------------------------------------------------
def test_readme_is_a_front_door():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move depth into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    readme = README.read_text()
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in re.findall(r"\]\(([^)\s#]+)[^)]*\)", readme)}
    missing = [p.relative_to(REPO).as_posix() for p in DOCS if p.resolve() not in linked]
    assert not missing, f"README.md links no [..](...) to: {', '.join(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_stale_key_or_path(page):
    problems = stale_refs(page.relative_to(REPO).as_posix(), page.read_text())
    assert not problems, "stale names in the docs:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_and_anchors_resolve(page):
    problems = broken_links(page, page.read_text())
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_layout_lists_every_module_once():
    problems = layout_problems(layout_block(README.read_text()))
    assert not problems, "\n".join(problems)


def test_configuration_reference_lists_every_key():
    text = (REPO / "docs" / "configuration.md").read_text()
    missing = sorted(k for k in leaf_keys() if f"`{k}`" not in text)
    assert not missing, "docs/configuration.md does not list: " + ", ".join(missing)


def test_every_shipped_config_is_named():
    text = "\n".join(p.read_text() for p in PAGES)
    missing = [p.relative_to(REPO).as_posix() for p in sorted((REPO / "configs").glob("*.yaml"))
               if p.relative_to(REPO).as_posix() not in text]
    assert not missing, f"README.md and docs/ never name: {', '.join(missing)}"


# -- the checker itself, on small strings ------------------------------------------------------------------
def test_checker_flags_stale_keys_paths_and_modules_not_prose():
    text = ("Prose: tracking.required, memfit/nowhere.py and model.name_or_path are not read.\n"
            "Set `tracking.required` and `train.{lr,max_stepz}`; `model.onnx` is a file, `data.digest` a param,\n"
            "`model.gradient_checkpointing_enable()` a call, `memfit.memory.warning` a tag; see `memfit/nowhere.py`,\n"
            "`memfit/config/__init__.py`, `bench/out/x.png` (an output) and `runs/tiny/checkpoints` (a run's).\n"
            "```bash\n"
            "memfit run configs/tiny.yaml --set checkpoint.every_steps=2 \\\n"
            "  --set checkpoint.spot.enabled=true --set checkpoint.evry_steps=2 configs/nope.yaml\n"
            "python -m memfit.cli --help && python -m memfit.nocli\n"
            "```\n")
    assert stale_refs("X.md", text) == [
        "X.md:2: `tracking.required` is not a config key (memfit/config/__init__.py)",
        "X.md:2: `train.max_stepz` is not a config key (memfit/config/__init__.py)",
        "X.md:3: `memfit/nowhere.py` does not exist in the repository",
        "X.md:7: `checkpoint.evry_steps` is not a config key (memfit/config/__init__.py)",
        "X.md:7: `configs/nope.yaml` does not exist in the repository",
        "X.md:8: module `memfit.nocli` does not exist",
    ]


def test_checker_knows_every_key_of_the_tree():
    assert {"checkpoint.every_steps", "checkpoint.spot.enabled", "eval.gate.max_perplexity",
            "tracking.fail_if_unreachable", "eval.gate"} <= KEYS
    assert "tracking.required" not in KEYS
    assert expand("eval.gate.{max_perplexity,beat_champion}") == ["eval.gate.max_perplexity",
                                                                 "eval.gate.beat_champion"]


def test_layout_check_flags_missing_extra_and_twice_listed_modules():
    block = ("memfit/        core\n  errors.py    errors\n  gone.py      removed\n  memory/      x\n"
             "    estimator/ y\n      probe.py z\n  memory/      again\ntasks/         train.py, nothing.py\n")
    problems = layout_problems(block)
    assert "README.md Layout: lists memfit/gone.py, which does not exist" in problems
    assert "README.md Layout: memfit/cli/ exists but is not listed" in problems
    assert "README.md Layout: lists memfit/memory/ 2 times" in problems
    assert "README.md Layout: top-level folder flows/ is not listed" in problems
    assert "README.md Layout: tasks/nothing.py does not exist" in problems
    assert not any(s in p for p in problems for s in ("memfit/errors.py", "memfit/memory/estimator/probe.py",
                                                              "tasks/train.py"))


def test_link_check_flags_missing_pages_and_anchors():
    page = REPO / "docs" / "x.md"  # resolved against the real docs/, never written
    text = "[a](memory.md#the-planner) [b](nowhere.md) [c](memory.md#no-such-heading) [d](https://example.com)"
    assert broken_links(page, text) == [
        "docs/x.md: link (nowhere.md): nowhere.md does not exist",
        "docs/x.md: link (memory.md#no-such-heading): docs/memory.md has no heading with anchor #no-such-heading",
    ]
