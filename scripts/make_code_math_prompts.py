"""Write ``data_prep/prompts/code_math.jsonl`` (``builtin:code_math``): a shifted-domain prompt set
of programming and math requests, for the traffic-adaptation loop (issue 18).

The prompts are written here from templates and seeded random choices (no public benchmark is
drawn from): code tasks (write, fix, explain, test, convert) over several languages, and math
tasks (arithmetic word problems, linear equations, percentages, unit conversion, series,
probability) with random numbers. Re-running with the same seed writes the same file.

    python scripts/make_code_math_prompts.py [--n-code 300] [--n-math 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data_prep" / "prompts" / "code_math.jsonl"

LANGS = ["Python", "JavaScript", "Rust", "Go", "C", "Java", "TypeScript", "Bash", "SQL", "C++"]
TASKS = [
    "returns the {k} largest numbers in a list", "checks whether a string is a palindrome, ignoring punctuation",
    "merges two sorted arrays into one sorted array", "counts the words in a text file",
    "parses a CSV line with quoted fields", "computes the nth Fibonacci number iteratively",
    "removes duplicate elements while keeping their order", "finds the longest common prefix of several strings",
    "converts a Roman numeral to an integer", "validates an IPv4 address",
    "rotates a matrix by 90 degrees", "implements binary search on a sorted list",
    "groups a list of words by their anagram class", "flattens a nested list of any depth",
    "computes a running median of a stream of numbers", "implements an LRU cache with capacity {k}",
    "reads a JSON file and prints every key path", "returns all primes below {n} with a sieve",
    "computes the edit distance between two strings", "splits a list into chunks of size {k}",
    "counts the frequency of each character in a string", "checks whether parentheses in a string are balanced",
    "converts a number of seconds into hours, minutes and seconds", "finds the two numbers in a list that sum to {n}",
    "transposes a matrix given as a list of rows", "implements a stack with a get_min operation in O(1)",
    "returns the day of the week for a given date", "deduplicates lines of a log file and sorts them",
    "computes the greatest common divisor of two integers", "serialises a binary tree to a string and back",
]
BUGGY = [
    ("Python", "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) - 1"),
    ("Python", "def last_n(items, n):\n    return items[len(items) - n - 1:]"),
    ("JavaScript", "function sum(arr) {\n  let s;\n  for (let i = 0; i <= arr.length; i++) s += arr[i];\n  return s;\n}"),
    ("Python", "def is_even(n):\n    if n % 2 == 1:\n        return True\n    return False"),
    ("C", "int max(int *a, int n) {\n  int m = 0;\n  for (int i = 1; i < n; i++) if (a[i] > m) m = a[i];\n  return m;\n}"),
    ("Python", "def count_vowels(s):\n    return sum(1 for c in s if c in 'aeiou')"),
    ("Go", "func reverse(s []int) {\n  for i := 0; i < len(s); i++ {\n    s[i], s[len(s)-1-i] = s[len(s)-1-i], s[i]\n  }\n}"),
    ("Python", "def factorial(n):\n    result = 0\n    for i in range(1, n + 1):\n        result *= i\n    return result"),
    ("SQL", "SELECT department, AVG(salary)\nFROM employees\nWHERE AVG(salary) > 50000\nGROUP BY department;"),
    ("Python", "def find(d, key):\n    for k in d:\n        if k == key:\n            return d[k]\n        else:\n            return None"),
]
SNIPPETS = [
    ("Python", "result = {k: v for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:{k}]}"),
    ("Python", "with open(path) as f:\n    rows = [line.rstrip('\\n').split(',') for line in f if line.strip()]"),
    ("JavaScript", "const unique = [...new Set(items.map(x => x.id))].filter(Boolean);"),
    ("Bash", "find . -name '*.log' -mtime +{k} -print0 | xargs -0 gzip"),
    ("SQL", ("SELECT c.name, COUNT(o.id) FROM customers c LEFT JOIN orders o ON o.customer_id = c.id "
            "GROUP BY c.name HAVING COUNT(o.id) > {k};")),
    ("Python", "pairs = list(zip(xs, xs[1:]))\ndiffs = [b - a for a, b in pairs]"),
    ("Rust", "let total: i64 = values.iter().filter(|v| **v > {k}).map(|v| v * 2).sum();"),
    ("Python", "@functools.lru_cache(maxsize=None)\ndef ways(n):\n    return 1 if n <= 1 else ways(n - 1) + ways(n - 2)"),
]
CODE_FORMS = [
    "Write a {lang} function that {task}. Include a short docstring or comment.",
    "In {lang}, implement a function that {task}, and explain its time complexity.",
    "Show me {lang} code that {task}, with two example calls.",
    "Write unit tests in {lang} for a function that {task}.",
    "How would you write a {lang} program that {task}? Keep it short.",
]
NAMES = ["Maya", "Tomas", "Priya", "Jonas", "Aiko", "Lucas", "Fatima", "Omar", "Elena", "Kwame"]
ITEMS = ["apples", "notebooks", "tickets", "bolts", "cupcakes", "tiles", "stamps", "batteries"]


def code_prompt(rng: random.Random) -> str:
    kind = rng.random()
    fill = {"k": rng.randint(2, 9), "n": rng.choice([50, 100, 200, 500, 1000])}
    if kind < 0.55:
        return rng.choice(CODE_FORMS).format(lang=rng.choice(LANGS), task=rng.choice(TASKS).format(**fill))
    if kind < 0.75:
        lang, code = rng.choice(BUGGY)
        return f"This {lang} code has a bug. Find it and give the corrected version:\n\n```\n{code}\n```"
    if kind < 0.9:
        lang, code = rng.choice(SNIPPETS)
        return f"Explain what this {lang} code does, line by line:\n\n```\n{code.replace('{k}', str(fill['k']))}\n```"
    src, dst = rng.sample(["Python", "JavaScript", "Go", "Rust", "Java"], 2)
    return f"Translate this {src} function into {dst}: a function that {rng.choice(TASKS).format(**fill)}."


def math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 12)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    forms = [
        (f"{name} buys {a} {item} at ${b}.{rng.randint(0, 99):02d} each and pays with ${(a * b // 10 + 2) * 10}. "
        "How much change does she get? Show the steps."),
        f"Solve for x: {c}x + {a} = {b * c + a}. Explain each step.",
        f"Solve the system: {c}x + {b}y = {c * 2 + b * 3}, x - y = {2 - 3}. Show your work.",
        f"What is {rng.randint(5, 95)}% of {rng.randint(40, 2000)}? Show how you compute it.",
        (f"A price rises by {rng.randint(5, 40)}% and then falls by {rng.randint(5, 40)}%. "
        "What is the overall percentage change? Explain."),
        (f"Convert {rng.randint(2, 500)} {rng.choice(['kilometres', 'miles', 'litres', 'pounds', 'feet'])} to "
        f"{rng.choice(['metres', 'kilometres', 'gallons', 'kilograms', 'inches'])} where it makes sense, "
        "and explain the conversion factor."),
        f"What is the sum of the first {a} positive integers? Derive the formula you use.",
        (f"A bag holds {a} red and {b} blue marbles. Two are drawn without replacement. "
        "What is the probability both are red? Show the calculation."),
        (f"A train travels {a * 10} km in {c} hours, then {b * 5} km in {rng.randint(1, 5)} hours. "
        "What is its average speed over the whole trip?"),
        f"Find the derivative of f(x) = {c}x^3 - {b}x^2 + {a}x - 7 and evaluate it at x = {rng.randint(-3, 4)}.",
        f"Compute the area of a triangle with sides {a}, {a + b // 2 + 1} and {a + b // 3 + 2}, using Heron's formula.",
        f"Is {rng.randint(101, 997)} a prime number? Explain how you check it.",
        f"The geometric series starts {c}, {c * 3}, {c * 9}, ... What is the sum of its first {rng.randint(4, 9)} terms?",
        (f"{name} saves ${b} in the first week and ${c} more each week than the week before. "
        f"How much has {name} saved after {rng.randint(5, 20)} weeks?"),
        f"Simplify the fraction {a * c}/{b * c} and write it as a decimal rounded to three places.",
    ]
    return rng.choice(forms)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-code", type=int, default=300)
    p.add_argument("--n-math", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    rows, seen = [], set()
    for category, make, n in (("code", code_prompt, args.n_code), ("math", math_prompt, args.n_math)):
        count = 0
        while count < n:
            text = make(rng)
            if text in seen:
                continue
            seen.add(text)
            count += 1
            rows.append({"id": f"{category}-{count:03d}", "category": category, "prompt": text})
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
