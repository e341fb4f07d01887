"""Two applications' traffic for the learn-cycle benchmark (``benchmarks/learning_cycle.py``).

    python -m benchmarks.learning.traffic          # rewrites captured.jsonl and heldout.jsonl here

- ``support``: the help desk of Orbit Notes (a fictional note-taking app) behind one fixed system
  prompt that asks for one answer format ("Summary: ... Steps: 1. ... 2. ...");
- ``code``: short Python tasks ("Write a Python function that ...") behind a fixed system prompt.

Each request is a subject (a task) in one of a few phrasings. ``captured.jsonl`` is what the server
serves and captures (every subject in every phrasing); ``heldout.jsonl`` is the same two
applications on subjects the captured set never names (two phrasings each), for measuring a
learnt draft on traffic it was not trained on. Rows: ``id``, ``app``, ``subject``, ``messages``
(system + user). Written here by hand, not taken from the everyday evaluation set.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
CAPTURED = HERE / "captured.jsonl"
HELDOUT = HERE / "heldout.jsonl"

SUPPORT_SYSTEM = (
    "You are the help desk assistant of Orbit Notes, a note-taking app for Windows, macOS, Android and "
    "iPhone. Answer every question in exactly this format and nothing else:\n"
    "Summary: one sentence.\n"
    "Steps:\n1. ...\n2. ...\n3. ...\n"
    "Use at most five steps. If the question is not about Orbit Notes, say so in the Summary and give no steps."
)
CODE_SYSTEM = (
    "You are a Python coding assistant. Answer with one Python code block containing the function, "
    "then at most two sentences of explanation. Use only the standard library."
)

SUPPORT_PHRASINGS = (
    "How do I {s}?",
    "I can't work out how to {s} in Orbit Notes. Can you help?",
    "What is the quickest way to {s}?",
    "Hi! My team asked me to {s}. What should I do?",
)
CODE_PHRASINGS = (
    "Write a Python function that {s}.",
    "Write a short Python function that {s}. Include a docstring.",
    "In Python, implement a function that {s}.",
    "Give me a Python function that {s}, and show one example call.",
)

SUPPORT_CAPTURED = (
    "export a notebook as a PDF", "share a note with a colleague by link", "restore a note I deleted yesterday",
    "change the default font of new notes", "turn on dark mode", "sync my notes between my phone and my laptop",
    "add a reminder to a note", "pin a note to the top of a notebook", "move a note to another notebook",
    "merge two notebooks into one", "lock a notebook with a password", "reset my Orbit Notes password",
    "change the email address of my account", "cancel my Orbit Notes Pro subscription",
    "get a refund for an annual plan", "attach a photo to a note", "record a voice memo inside a note",
    "search for text inside attached PDFs", "tag several notes at once", "rename a tag",
    "print a note without the sidebar", "import my notes from a text file",
    "back up all my notebooks to my computer", "see the older versions of a note", "turn off notification sounds",
    "use Orbit Notes without an internet connection", "add a checklist to a note", "create a note from an email",
    "set up two-factor sign-in", "sign out of Orbit Notes on a lost phone", "change the language of the app",
    "make the text in the editor larger", "add a table to a note", "link one note to another",
    "invite a family member to a shared notebook", "stop other people from editing a shared notebook",
    "delete my account and all my data", "install the browser clipper", "fix notes that are stuck on Syncing",
    "free up the storage Orbit Notes uses on my phone", "scan a paper document into a note",
    "set a notebook as the default for new notes",
)
SUPPORT_HELDOUT = (
    "export all my notes to Markdown", "change the colour of a notebook", "add a due date to a checklist item",
    "hide a notebook from the sidebar", "draw a sketch inside a note", "copy a note into a shared notebook",
    "transfer my Pro plan to a new account", "undo an accidental edit in a long note",
    "see who edited a shared note last", "turn off spell checking", "set up Orbit Notes on a new tablet",
    "report a bug in the iPhone app", "sort notes by the date they were created", "find notes that have no tag",
    "open a note in a separate window", "add a keyboard shortcut for a new note",
    "move the app data to a new computer", "embed a video link in a note",
)
CODE_CAPTURED = (
    "reverses the words in a sentence", "returns the n-th Fibonacci number", "checks whether a string is a palindrome",
    "counts the vowels in a string", "removes duplicates from a list while keeping the order",
    "returns the largest of three numbers", "computes the factorial of n", "checks whether a number is prime",
    "flattens a list of lists", "merges two sorted lists into one sorted list",
    "returns the most common word in a text", "converts a temperature from Celsius to Fahrenheit",
    "sums the digits of an integer", "returns the second largest number in a list",
    "checks whether two strings are anagrams", "capitalizes the first letter of every word",
    "computes the greatest common divisor of two numbers", "splits a list into chunks of size n",
    "counts how many times each character appears in a string", "returns the running total of a list of numbers",
    "finds the index of a value in a sorted list with binary search", "converts a Roman numeral to an integer",
    "checks whether a year is a leap year", "reads a text file and returns its number of lines",
    "returns the intersection of two lists", "rotates a list by k positions",
    "checks whether the brackets in a string are balanced", "converts a list of pairs into a dictionary",
    "returns the average of a list of numbers, or None if it is empty", "removes all whitespace from a string",
    "generates the first n prime numbers", "returns the longest word in a sentence",
    "transposes a matrix given as a list of lists", "converts a binary string to an integer",
    "checks whether a list is sorted", "returns the median of a list of numbers",
    "replaces every vowel in a string with an asterisk", "groups a list of words by their first letter",
    "returns the squares of the even numbers in a list", "checks that a string looks like an email address",
    "computes the power set of a small list", "formats a number of seconds as hours, minutes and seconds",
)
CODE_HELDOUT = (
    "returns the least common multiple of two numbers", "compresses a string with run-length encoding",
    "returns the Hamming distance between two strings of equal length", "counts the words in a text file",
    "checks whether a number is a perfect square", "returns every pair of numbers in a list that adds up to a target",
    "converts the keys of a dictionary to upper case", "finds the longest common prefix of a list of strings",
    "removes every key whose value is None from a dictionary", "returns the n largest values of a list",
    "converts snake_case text to camelCase", "checks whether a string contains only digits",
    "computes the dot product of two vectors", "returns the number of days between two dates given as strings",
    "interleaves two lists element by element", "computes the mean and standard deviation of a list",
    "truncates a string to n characters and adds an ellipsis", "finds the missing number in a list of 1 to n",
)

APPS = {
    "support": (SUPPORT_SYSTEM, SUPPORT_PHRASINGS, SUPPORT_CAPTURED, SUPPORT_HELDOUT),
    "code": (CODE_SYSTEM, CODE_PHRASINGS, CODE_CAPTURED, CODE_HELDOUT),
}
HELDOUT_PHRASINGS = 2  # per held-out subject, rotating over the phrasings


def _row(app: str, split: str, i: int, system: str, phrasing: str, subject: str) -> dict:
    return {"id": f"{app}-{split}-{i}", "app": app, "subject": subject,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": phrasing.format(s=subject)}]}


def build() -> tuple[list[dict], list[dict]]:
    """The captured and the held-out rows (interleaved by application, so any prefix has both)."""
    captured: dict[str, list[dict]] = {}
    heldout: dict[str, list[dict]] = {}
    for app, (system, phrasings, seen, unseen) in APPS.items():
        captured[app] = [_row(app, "captured", len(phrasings) * i + j, system, p, s)
                         for j, p in enumerate(phrasings) for i, s in enumerate(seen)]
        heldout[app] = [_row(app, "heldout", HELDOUT_PHRASINGS * i + j, system,
                             phrasings[(i + j) % len(phrasings)], s)
                        for j in range(HELDOUT_PHRASINGS) for i, s in enumerate(unseen)]
    return _interleave(captured), _interleave(heldout)


def _interleave(by_app: dict[str, list[dict]]) -> list[dict]:
    out = []
    for group in zip(*by_app.values(), strict=True):
        out.extend(group)
    return out


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def disjoint_subjects(captured: list[dict], heldout: list[dict]) -> None:
    """Raise unless no subject of the held-out rows is a subject of the captured ones."""
    shared = {r["subject"].casefold() for r in captured} & {r["subject"].casefold() for r in heldout}
    if shared:
        raise ValueError(f"held-out subjects also captured: {sorted(shared)}")


def write() -> None:
    captured, heldout = build()
    disjoint_subjects(captured, heldout)
    for path, rows in ((CAPTURED, captured), (HELDOUT, heldout)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} rows, {len({r['subject'] for r in rows})} subjects")


if __name__ == "__main__":
    write()
