"""Prompt sets for bench/bench_core.py: the tasks people run through a small instruct model.

Each set is a list of user messages (the benchmark applies the target's chat template). The edit and JSON
sets supply the text the answer is made of, the way editing a given document works: that is where prompt
lookup (the `ngram` drafter) has something to copy. `free` is the control: answers the prompt does not
contain, where speculation must not make things slower.
"""

from __future__ import annotations

# ---------------------------------------------------------------- edits / rewrites of a supplied text

_REPORT = (
    "The quarterly report shows that revenue increased by twelve percent compared to the previous year, "
    "driven mainly by strong sales in the European market. However, operating costs also rose sharply due to "
    "higher energy prices and new hiring. The board recommends a cautious approach to expansion in the coming "
    "year, focusing on efficiency and customer retention rather than new markets."
)

_TYPOS = (
    "Our team meet every monday to discus the progres of the project. Last week we finaly finished the "
    "first version of the aplication and sent it to the customer for review. The customer was happy with "
    "the design but asked for a few changes to the login page and the search function. We expect to "
    "deliver the updated version before the end of the month."
)

_EMAIL = (
    "Hi Sarah,\n\nThank you for your message. The meeting with the design team is scheduled for Tuesday at "
    "10 am in room 4B. Please bring the latest sketches and the budget overview. If Tuesday does not work "
    "for you, let me know and we will find another time.\n\nBest regards,\nTom"
)

_RECIPE = (
    "To make the pancakes, mix two cups of flour, two eggs, one cup of milk and a pinch of salt in a large "
    "bowl. Whisk until the batter is smooth. Heat a pan over medium heat and add a little butter. Pour a "
    "small amount of batter into the pan and cook until bubbles form on the surface. Flip the pancake and "
    "cook for another minute. Serve warm with honey or fresh fruit."
)

_NOTICE = (
    "The library will be closed on Friday for maintenance. During this time, the online catalogue and the "
    "study rooms will not be available. Books that are due on Friday can be returned on Saturday without "
    "a late fee. We apologize for the inconvenience and thank you for your patience."
)

_CODE_RENAME = """def calc(a, b):
    t = 0
    for x in a:
        if x > b:
            t = t + x
    return t


def avg(a):
    t = 0
    for x in a:
        t = t + x
    return t / len(a)
"""

_README = (
    "## Installation\n\n"
    "1. Clone the repository.\n"
    "2. Create a virtual environment with python -m venv .venv.\n"
    "3. Install the dependencies with pip install -r requirements.txt.\n"
    "4. Copy the file config.example.yaml to config.yaml and edit the database settings.\n"
    "5. Run the tests with pytest to check that everything works.\n"
)

EDITS = [
    "Fix the spelling in this text:\n\n" + _TYPOS,
    'Rewrite the following paragraph, replacing the word "revenue" with "turnover". Return the whole '
    "paragraph.\n\n" + _REPORT,
    "Change the day of the meeting in this email from Tuesday to Thursday. Return the full email.\n\n" + _EMAIL,
    "Replace every number written in words with digits in this recipe. Keep everything else the same.\n\n" + _RECIPE,
    "Rename the variable t to total and the variable x to value in this code. Return the full code.\n\n" + _CODE_RENAME,
    "Edit this notice so that the library is closed on Monday instead of Friday. Return the full notice.\n\n" + _NOTICE,
    "Add a step 6 to these instructions that says to start the server with make run. Return all the "
    "instructions.\n\n" + _README,
    "Proofread this paragraph. Return the corrected paragraph only.\n\n" + _REPORT.replace(" the ", " teh ", 2),
]

# ---------------------------------------------------------------- JSON / templated output

JSON = [
    "Fill this JSON record from the fields below. Output only the JSON.\n\n"
    '{"name": "", "email": "", "city": "", "age": 0, "member": false}\n\n'
    "Fields: name is Maria Lopez, email is maria.lopez@example.com, city is Madrid, age is 34, member is true.",
    "Convert this table to a JSON list of objects with the keys id, product, price and stock. Output only "
    "the JSON.\n\n"
    "| id | product | price | stock |\n|----|---------|-------|-------|\n"
    "| 1 | Keyboard | 49.99 | 120 |\n| 2 | Mouse | 19.99 | 340 |\n| 3 | Monitor | 189.00 | 45 |\n"
    "| 4 | Webcam | 59.50 | 80 |",
    "Convert this CSV to JSON, one object per line of data. Output only the JSON.\n\n"
    "city,country,population\nTokyo,Japan,37400000\nDelhi,India,31000000\nShanghai,China,27100000\n"
    "Sao Paulo,Brazil,22000000\nMexico City,Mexico,21800000",
    'Return this JSON with the status of every task set to "done". Output only the JSON.\n\n'
    '{"tasks": [{"id": 1, "title": "Write the report", "status": "open"}, '
    '{"id": 2, "title": "Review the budget", "status": "open"}, '
    '{"id": 3, "title": "Send the invoices", "status": "in progress"}, '
    '{"id": 4, "title": "Book the meeting room", "status": "open"}]}',
    "Fill in the template with the values below and return the filled template.\n\n"
    "Template:\nDear {name},\n\nYour order {order_id} of {quantity} x {item} has been shipped on {date}. "
    "It will arrive at {address} within {days} days.\n\nThank you for shopping with us.\n\n"
    "Values: name = John Smith, order_id = A-10234, quantity = 2, item = wireless headphones, "
    "date = 3 March, address = 12 High Street, Leeds, days = 3",
    "Pretty-print this JSON with an indent of 2 spaces.\n\n"
    '{"id": 42, "user": {"name": "Anna Berg", "email": "anna.berg@example.com"}, "items": [{"sku": "A-100", '
    '"qty": 2}, {"sku": "B-220", "qty": 1}], "total": 87.5, "paid": true}',
    'Rename the key "title" to "name" in every object of this JSON and return it.\n\n'
    '{"tasks": [{"id": 1, "title": "Write the report", "status": "open"}, '
    '{"id": 2, "title": "Review the budget", "status": "open"}, '
    '{"id": 3, "title": "Send the invoices", "status": "done"}, '
    '{"id": 4, "title": "Book the meeting room", "status": "open"}]}',
    "Write a JSON object describing this book with the keys title, author, year, pages and genres (a list). "
    "Output only the JSON.\n\n"
    "The book is Pride and Prejudice by Jane Austen, published in 1813. It has 432 pages. "
    "Its genres are romance, classic and fiction.",
]

# ---------------------------------------------------------------- code: complete or modify a given function

CODE = [
    "Add a docstring to this function. Return the full function.\n\n"
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n"
    "            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n    return result",
    "Add type hints to this Python function. Return the full function.\n\n"
    "def count_words(text, min_length):\n    counts = {}\n    for word in text.split():\n"
    "        word = word.lower().strip('.,!?')\n        if len(word) >= min_length:\n"
    "            counts[word] = counts.get(word, 0) + 1\n    return counts",
    "Fix the bug in this function: it should return the largest number in the list. Return the full "
    "corrected function.\n\n"
    "def find_max(numbers):\n    best = 0\n    for n in numbers:\n        if n < best:\n            best = n\n"
    "    return best",
    "Complete this Python class by adding a method withdraw(amount) that raises ValueError if the balance "
    "is too low. Return the whole class.\n\n"
    "class BankAccount:\n    def __init__(self, owner, balance=0):\n        self.owner = owner\n"
    "        self.balance = balance\n\n    def deposit(self, amount):\n        if amount <= 0:\n"
    '            raise ValueError("amount must be positive")\n        self.balance += amount\n'
    "        return self.balance",
    "Rewrite this function to use a list comprehension. Return the full function.\n\n"
    "def squares_of_even(numbers):\n    result = []\n    for n in numbers:\n        if n % 2 == 0:\n"
    "            result.append(n * n)\n    return result",
    "Add error handling to this function so that it returns None when the file does not exist. Return the "
    "full function.\n\n"
    "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n        data = json.load(f)\n"
    "    return data",
    "Translate this JavaScript function to Python.\n\n"
    "function fizzbuzz(n) {\n  const out = [];\n  for (let i = 1; i <= n; i++) {\n"
    "    if (i % 15 === 0) out.push('FizzBuzz');\n    else if (i % 3 === 0) out.push('Fizz');\n"
    "    else if (i % 5 === 0) out.push('Buzz');\n    else out.push(String(i));\n  }\n  return out;\n}",
    "Write a Python function is_palindrome(s) that ignores case and spaces, and a few asserts that test it.",
]

# ---------------------------------------------------------------- free-form questions (the control)

FREE = [
    "Explain why the sky is blue in a short paragraph.",
    "Write a short essay about the importance of sleep.",
    "What are the main differences between a cat and a dog as pets?",
    "Give me three tips for learning a new language.",
    "Describe how a bicycle works.",
    "Why do leaves change color in autumn?",
    "Write a short story about a robot who learns to paint.",
    "What is the water cycle? Explain it simply.",
]

# ---------------------------------------------------------------- templated reports (one bulk job)

# A bulk job fills the same instructions with different fields: the outputs share structure and phrasing across
# requests, which a job-wide memory of outputs can draft from. Run as one job, in this order (templates mixed).
_STATUS = (
    "Write a weekly status report for the {team} team using exactly these sections: Summary, Completed this "
    "week, Planned for next week, Risks. Keep it factual and under 150 words.\n"
    "Completed: {done}\nPlanned: {planned}\nRisks: {risks}"
)
_PRODUCT = (
    "Write a product description for our online shop. Start with the product name as a heading, then one "
    "sentence on who it is for, then a bullet list of the key features, then one line with the price.\n"
    "Product: {name}\nFor: {audience}\nFeatures: {features}\nPrice: {price}"
)
_SUPPORT = (
    "Write a reply to a customer support ticket. Greet the customer by name, apologize for the problem, "
    "explain the next steps in a numbered list, and end with our standard sign-off: "
    '"Kind regards, the Brightline Support Team".\n'
    "Customer: {customer}\nProblem: {problem}\nNext steps: {steps}"
)

_STATUS_FIELDS = [
    (
        "Payments",
        "migrated the invoice service to the new database; fixed the duplicate refund bug",
        "load test the checkout flow; start the currency conversion work",
        "the bank API sandbox is unstable",
    ),
    (
        "Mobile",
        "released version 4.2 to the app stores; added dark mode to the settings screen",
        "fix crash reports from older Android phones; review the onboarding design",
        "one developer is on leave",
    ),
    (
        "Data Platform",
        "moved the nightly jobs to the new scheduler; cut storage costs by 15 percent",
        "document the new pipelines; add alerts for late jobs",
        "the old cluster must be shut down by the 30th",
    ),
    (
        "Search",
        "improved ranking for product names; reduced query latency to 120 ms",
        "add spelling suggestions; run an A/B test on the new ranking",
        "the test traffic may be too low",
    ),
    (
        "Security",
        "rotated all service credentials; finished the phishing training for new hires",
        "review third-party access; update the incident response plan",
        "two audits fall in the same week",
    ),
    (
        "Customer Success",
        "onboarded five new enterprise customers; closed 140 tickets",
        "prepare the quarterly business reviews; update the help center articles",
        "ticket volume is rising",
    ),
    (
        "Infrastructure",
        "upgraded the load balancers; removed unused virtual machines",
        "test the disaster recovery plan; patch the database servers",
        "the patch window is short",
    ),
    (
        "Marketing",
        "launched the spring campaign; published two customer case studies",
        "plan the webinar series; refresh the pricing page",
        "the agency contract ends next month",
    ),
]
_PRODUCT_FIELDS = [
    (
        "TrailLite 2 Tent",
        "hikers who want a light shelter",
        "weighs 1.2 kg; sets up in five minutes; two doors",
        "189 EUR",
    ),
    (
        "AquaPure Bottle",
        "commuters and gym goers",
        "filters tap water; keeps drinks cold for 24 hours; 750 ml",
        "35 EUR",
    ),
    ("QuietDesk Fan", "people working from home", "almost silent; three speeds; USB powered", "29 EUR"),
    ("ChefPro Knife Set", "home cooks", "five stainless steel knives; wooden block; dishwasher safe", "120 EUR"),
    ("SleepWell Pillow", "side sleepers", "memory foam; washable cover; keeps its shape", "59 EUR"),
    ("PixelFrame", "families who share photos", "10 inch screen; Wi-Fi photo sharing; motion sensor", "99 EUR"),
    ("RunTrack Watch", "runners training for a race", "GPS tracking; heart rate monitor; 7-day battery", "149 EUR"),
    ("BrewMate Kettle", "tea lovers", "five temperature settings; keep-warm mode; 1.7 litres", "69 EUR"),
]
_SUPPORT_FIELDS = [
    (
        "Anna Berg",
        "she was charged twice for her March subscription",
        "we refund the second charge; the refund appears within 5 days; we add a free month",
    ),
    (
        "David Kim",
        "his order arrived with a broken screen",
        "he sends a photo of the damage; we ship a replacement; he returns the broken unit with our label",
    ),
    (
        "Maria Lopez",
        "she cannot log in after changing her email address",
        "we reset her login; she confirms the new address; she sets a new password",
    ),
    (
        "Tom Fischer",
        "the app crashes when he uploads a photo",
        "he updates the app to the latest version; he sends us the crash report; we follow up within 2 days",
    ),
    (
        "Priya Shah",
        "her delivery is a week late",
        "we contact the carrier; we send her the new delivery date; we refund the shipping cost",
    ),
    (
        "Lukas Meyer",
        "he received the wrong size of shoes",
        "he returns the shoes with our label; we send the right size; the exchange is free",
    ),
    (
        "Sofia Rossi",
        "her discount code was not applied at checkout",
        "we apply the discount as a refund; she receives a confirmation email; the code stays valid",
    ),
    (
        "James Carter",
        "he wants to cancel his subscription but cannot find the button",
        "we cancel it for him; he receives a confirmation; his data is kept for 30 days",
    ),
]

_STATUS_PROMPTS = [_STATUS.format(team=t, done=d, planned=p, risks=r) for t, d, p, r in _STATUS_FIELDS]
_PRODUCT_PROMPTS = [_PRODUCT.format(name=n, audience=a, features=f, price=p) for n, a, f, p in _PRODUCT_FIELDS]
_SUPPORT_PROMPTS = [_SUPPORT.format(customer=c, problem=p, steps=s) for c, p, s in _SUPPORT_FIELDS]
TEMPLATED = [p for group in zip(_STATUS_PROMPTS, _PRODUCT_PROMPTS, _SUPPORT_PROMPTS) for p in group]

SETS: dict[str, list[str]] = {"edits": EDITS, "json": JSON, "code": CODE, "free": FREE, "templated": TEMPLATED}

# max_new_tokens per set: long enough that copying dominates where the answer copies the prompt
MAX_NEW_TOKENS: dict[str, int] = {"edits": 160, "json": 160, "code": 128, "free": 64, "templated": 160}

DESCRIPTIONS: dict[str, str] = {
    "edits": "edits/rewrites of a supplied paragraph, email, list or code (the answer copies the input)",
    "json": "JSON/templated output filled from supplied fields, tables, CSV, YAML",
    "code": "complete or modify a supplied function",
    "free": "free-form questions and short essays (nothing to copy)",
    "templated": "one bulk job of 24 templated reports (status reports, product descriptions, support replies)",
}
