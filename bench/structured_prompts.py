"""The JSON-schema bench set of bench/bench_structured.py: extraction, classification and invoices, the jobs
bulk structured output is mostly made of. Each item is (kind, user message, schema); schemas are written the
way OpenAI's strict mode wants them (every property required, no others allowed)."""

from __future__ import annotations

from typing import Any


def obj(properties: dict[str, Any]) -> dict[str, Any]:
    """A strict object schema: every property required, nothing else allowed."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}


def enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


CONTACT = obj({"name": STR, "email": STR, "phone": STR, "company": STR})
EVENT = obj({"title": STR, "date": STR, "time": STR, "location": STR, "attendees": {"type": "array", "items": STR}})
PRODUCT = obj({"name": STR, "brand": STR, "price": NUM, "currency": STR, "in_stock": BOOL})
JOB = obj(
    {
        "title": STR,
        "company": STR,
        "location": STR,
        "remote": BOOL,
        "salary_min": INT,
        "salary_max": INT,
        "skills": {"type": "array", "items": STR},
    }
)
ADDRESS = obj({"street": STR, "city": STR, "postal_code": STR, "country": STR})
PERSON = obj({"name": STR, "age": INT, "occupation": STR, "city": STR})

SENTIMENT = obj({"sentiment": enum("positive", "negative", "neutral"), "confidence": NUM})
TICKET = obj(
    {
        "category": enum("billing", "technical", "account", "shipping", "other"),
        "priority": enum("low", "medium", "high", "urgent"),
        "summary": STR,
    }
)
LANGUAGE = obj({"language": enum("english", "french", "german", "spanish", "italian"), "is_question": BOOL})
SPAM = obj({"is_spam": BOOL, "reason": STR})
TOPIC = obj(
    {
        "topic": enum("sports", "politics", "technology", "health", "business", "entertainment"),
        "keywords": {"type": "array", "items": STR},
    }
)
INTENT = obj(
    {
        "intent": enum("book_flight", "cancel_booking", "check_status", "ask_question", "complain"),
        "destination": {"type": ["string", "null"]},
    }
)

LINE = obj({"description": STR, "quantity": INT, "unit_price": NUM})
INVOICE = obj(
    {
        "invoice_number": STR,
        "date": STR,
        "vendor": STR,
        "customer": STR,
        "items": {"type": "array", "items": LINE},
        "total": NUM,
        "currency": STR,
    }
)
RECEIPT = obj(
    {
        "store": STR,
        "date": STR,
        "items": {"type": "array", "items": obj({"name": STR, "price": NUM})},
        "total": NUM,
        "payment_method": enum("cash", "card", "other"),
    }
)

SET: list[tuple[str, str, dict[str, Any]]] = [
    # ---------------------------------------------------------------- extraction
    (
        "extraction",
        "Extract the contact details as JSON.\n\nHi, this is Maria Gonzalez from Brightline Logistics. "
        "You can reach me at maria.gonzalez@brightline.com or call 555-0142 any weekday.",
        CONTACT,
    ),
    (
        "extraction",
        "Extract the event as JSON.\n\nReminder: the quarterly planning meeting is on March 14 at 9:30 am "
        "in the Oak conference room. Attending: Dana, Luis, Priya and Tom.",
        EVENT,
    ),
    (
        "extraction",
        "Extract the product as JSON.\n\nThe Nordic Trail 45 backpack by Fjallgear costs 129.99 EUR. "
        "Currently in stock in all sizes.",
        PRODUCT,
    ),
    (
        "extraction",
        "Extract the job posting as JSON.\n\nSenior Data Engineer at Quantix, Berlin (hybrid, remote "
        "two days a week). Salary 70000 to 85000 per year. Required: Python, SQL, Spark and Airflow.",
        JOB,
    ),
    (
        "extraction",
        "Extract the address as JSON.\n\nPlease ship the order to 221 Baker Street, London, NW1 6XE, United Kingdom.",
        ADDRESS,
    ),
    (
        "extraction",
        "Extract the person as JSON.\n\nJames Okafor, 42, works as a civil engineer and lives in Lagos.",
        PERSON,
    ),
    # ---------------------------------------------------------------- classification
    (
        "classification",
        "Classify the sentiment of this review as JSON.\n\nThe battery lasts all day and the "
        "screen is gorgeous, but the speakers are a bit weak. Overall I am very happy with it.",
        SENTIMENT,
    ),
    (
        "classification",
        "Classify the sentiment of this review as JSON.\n\nArrived broken, and customer service "
        "never answered my emails. Waste of money.",
        SENTIMENT,
    ),
    (
        "classification",
        "Classify this support ticket as JSON.\n\nI was charged twice for my subscription this "
        "month and I need a refund as soon as possible.",
        TICKET,
    ),
    (
        "classification",
        "Classify this support ticket as JSON.\n\nThe app crashes every time I try to upload a photo from my phone.",
        TICKET,
    ),
    (
        "classification",
        "Detect the language of this message as JSON.\n\nBonjour, est-ce que le magasin est ouvert dimanche ?",
        LANGUAGE,
    ),
    (
        "classification",
        "Is this email spam? Answer as JSON.\n\nCongratulations! You have been selected to "
        "receive a free cruise. Click the link and enter your card details to claim your prize.",
        SPAM,
    ),
    (
        "classification",
        "Classify the topic of this headline as JSON.\n\nCentral bank raises interest rates for "
        "the third time this year as inflation stays high.",
        TOPIC,
    ),
    (
        "classification",
        "Classify the intent of this customer message as JSON.\n\nI need a flight to Lisbon next "
        "Friday, preferably in the morning.",
        INTENT,
    ),
    # ---------------------------------------------------------------- invoices
    (
        "invoice",
        "Extract the invoice as JSON.\n\nINVOICE #INV-2024-0193\nDate: 2024-05-02\nFrom: Acme Office "
        "Supplies\nBill to: Northwind Traders\n\n3 x Printer paper (A4, 500 sheets) @ 6.50\n2 x Black toner "
        "cartridge @ 48.00\n1 x Desk organizer @ 15.90\n\nTotal: 131.40 USD",
        INVOICE,
    ),
    (
        "invoice",
        "Extract the invoice as JSON.\n\nFactura n. F-88/2024, 12/03/2024. Proveedor: Talleres Ruiz SL. "
        "Cliente: Hotel Miramar. 4 x Revision de caldera a 85,00; 1 x Valvula de presion a 32,50. Total: 372,50 "
        "EUR.",
        INVOICE,
    ),
    (
        "invoice",
        "Extract the invoice as JSON.\n\nInvoice 5521 dated June 30, 2024 from CloudNest Hosting to "
        "Lumen Analytics: 12 x Virtual server (monthly) at 40.00, 1 x Backup storage 2TB at 25.00. Amount due: "
        "505.00 USD.",
        INVOICE,
    ),
    (
        "invoice",
        "Extract the receipt as JSON.\n\nGREEN MARKET  2024-07-19\nBananas 1.29\nWhole milk 2L 2.49\n"
        "Sourdough bread 3.80\nTOTAL 7.58\nPaid by card",
        RECEIPT,
    ),
]
