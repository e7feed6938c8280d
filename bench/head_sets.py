"""Generated request sets for bench_heads.py: a few hundred requests of one kind each, from templates with seeded
random fields, so a head can be trained on one part and measured on requests it never saw.

- notices: templated maintenance notices (the same form, new facts): a job run again and again;
- reports: templated status reports;
- free: free-text questions on many topics (new text: nothing to copy);
- edits: fix the typos in a sentence (the output copies the input, with corrections).
"""

from __future__ import annotations

import random

_BUILDINGS = [
    "Maple Court",
    "Harbor View",
    "Oak Street 12",
    "Riverside Tower",
    "Elm House",
    "Northgate Flats",
    "Cedar Lane 4",
    "Parkside",
    "The Old Mill",
    "Station Square",
]
_SERVICES = ["water supply", "electricity", "heating", "elevator", "internet connection", "hot water", "gas supply"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
_HOURS = ["8 am", "9 am", "10 am", "11 am", "1 pm", "2 pm", "3 pm"]
_REASONS = [
    "scheduled maintenance",
    "a pipe replacement",
    "safety inspections",
    "a meter upgrade",
    "repairs after the storm",
]
_ACTIONS = [
    "store some water in advance",
    "use the stairs",
    "charge their devices beforehand",
    "keep windows closed",
    "contact the caretaker with questions",
]
_PROJECTS = [
    "Apollo",
    "Billing v2",
    "Mobile app",
    "Data lake",
    "Search revamp",
    "Onboarding",
    "Payments API",
    "Help center",
]
_DONE = [
    "finished the design review",
    "shipped the beta",
    "fixed the login bug",
    "migrated the database",
    "wrote the test plan",
    "hired two engineers",
    "closed 40 tickets",
]
_NEXT = [
    "start the public launch",
    "run the load tests",
    "update the documentation",
    "train the support team",
    "remove the old endpoints",
    "plan the next quarter",
]
_RISKS = ["a vendor delay", "limited QA time", "an open security review", "budget approval", "none so far"]
_TOPICS = [
    "photosynthesis",
    "inflation",
    "black holes",
    "the immune system",
    "machine learning",
    "volcanoes",
    "the water cycle",
    "compound interest",
    "plate tectonics",
    "vaccines",
    "electric cars",
    "the printing press",
    "climate change",
    "DNA",
    "the stock market",
    "rainbows",
    "earthquakes",
    "recycling",
    "sleep",
    "the moon",
]
_AUDIENCES = ["a ten-year-old", "a busy manager", "a first-year student", "my grandmother", "a new employee"]
_QUESTIONS = [
    "Explain {t} to {a} in three sentences.",
    "What are two surprising facts about {t}?",
    "Write a short paragraph about why {t} matters.",
    "Give {a} one practical tip related to {t}.",
]
_SUBJECTS = ["The new manager", "Our neighbour", "The delivery driver", "My sister", "The committee", "The teacher"]
_VERBS = ["announced", "explained", "confirmed", "forgot", "reported", "suggested"]
_OBJECTS = [
    "that the meeting moves to Thursday",
    "the results of the survey",
    "a change to the schedule",
    "that the library closes early",
    "the plan for the summer festival",
    "the price of the tickets",
]


def _typos(sentence: str, rng: random.Random, n: int = 2) -> str:
    """n swapped letter pairs inside words (typos a spell checker would flag)."""
    chars = list(sentence)
    spots = [i for i in range(len(chars) - 1) if chars[i].isalpha() and chars[i + 1].isalpha()]
    for i in rng.sample(spots, min(n, len(spots))):
        chars[i], chars[i + 1] = chars[i + 1], chars[i]
    return "".join(chars)


def notice(rng: random.Random) -> str:
    return (
        f"Write a short notice for the residents of {rng.choice(_BUILDINGS)}: the {rng.choice(_SERVICES)} will be "
        f"off on {rng.choice(_DAYS)} from {rng.choice(_HOURS)} to {rng.choice(_HOURS)} because of "
        f"{rng.choice(_REASONS)}. Ask them to {rng.choice(_ACTIONS)}. Use a title line and sign as 'The caretaker'."
    )


def report(rng: random.Random) -> str:
    done, nxt = rng.sample(_DONE, 2), rng.choice(_NEXT)
    return (
        f"Write a status report for project {rng.choice(_PROJECTS)} with the sections Done, Next and Risks. "
        f"Done: we {done[0]} and {done[1]}. Next: {nxt}. Risks: {rng.choice(_RISKS)}."
    )


def free(rng: random.Random) -> str:
    return rng.choice(_QUESTIONS).format(t=rng.choice(_TOPICS), a=rng.choice(_AUDIENCES))


def edit(rng: random.Random) -> str:
    sentence = (
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} during the {rng.choice(_DAYS)} call."
    )
    return f"Fix the typos and return only the corrected sentence: {_typos(sentence, rng)}"


MAKERS = {"notices": notice, "reports": report, "free": free, "edits": edit}


def generated_set(kind: str, n: int, seed: int = 0) -> list[str]:
    """n distinct prompts of one kind (seeded)."""
    rng, out, seen = random.Random(f"{kind}:{seed}"), [], set()
    for _ in range(n * 50):
        p = MAKERS[kind](rng)
        if p not in seen:
            seen.add(p)
            out.append(p)
            if len(out) == n:
                break
    return out
