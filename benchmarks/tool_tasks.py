"""The tasks of benchmarks/tool_calls.py: three toolboxes of four functions (JSON schemas),
64 user messages with the calls each should make (or none), the checks on their arguments,
and a made-up result for every function."""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import permutations
from typing import Any

S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741


def fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    function = {"name": name, "description": description, "parameters": schema}
    return {"type": "function", "function": function}


BOXES: dict[str, list[dict[str, Any]]] = {
    "travel": [
        fn("get_weather", "The current weather in a city",
           {"city": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
        fn("get_time", "The current local time in a time zone or city", {"zone": S}, ["zone"]),
        fn("convert_currency", "Convert an amount of money from one currency to another",
           {"amount": {"type": "number"}, "from_currency": S, "to_currency": S},
           ["amount", "from_currency", "to_currency"]),
        fn("book_table", "Book a table at a restaurant",
           {"restaurant": S, "time": S,
            "party": {"type": "object", "properties": {"adults": I, "children": I},
                      "required": ["adults"]}},
           ["restaurant", "time", "party"]),
    ],
    "office": [
        fn("send_email", "Send an email", {"to": S, "subject": S, "body": S},
           ["to", "subject", "body"]),
        fn("create_event", "Create a calendar event with attendees",
           {"title": S,
            "start": {"type": "object", "properties": {"date": S, "time": S},
                      "required": ["date", "time"]},
            "attendees": {"type": "array", "items": {
                "type": "object", "properties": {"name": S, "email": S}, "required": ["name"]}}},
           ["title", "start", "attendees"]),
        fn("add_todo", "Add a task to the to-do list",
           {"task": S, "priority": {"type": "string", "enum": ["low", "medium", "high"]}},
           ["task", "priority"]),
        fn("search_web", "Search the web", {"query": S}, ["query"]),
    ],
    "shop": [
        fn("get_stock_price", "The latest price of a stock by its ticker symbol",
           {"symbol": S}, ["symbol"]),
        fn("order_pizza", "Order pizzas for delivery",
           {"items": {"type": "array", "items": {
               "type": "object",
               "properties": {"name": S, "size": {"type": "string",
                                                  "enum": ["small", "medium", "large"]},
                              "quantity": I},
               "required": ["name", "size", "quantity"]}},
            "address": {"type": "object", "properties": {"street": S, "city": S},
                        "required": ["street", "city"]}},
           ["items", "address"]),
        fn("calculate", "Evaluate an arithmetic expression", {"expression": S}, ["expression"]),
        fn("translate", "Translate text into another language",
           {"text": S, "target_language": S}, ["text", "target_language"]),
    ],
}  # fmt: skip


@dataclass(frozen=True)
class Task:
    id: str
    box: str
    kind: str  # single, multi, nested, none
    user: str
    expect: tuple[tuple[str, dict[str, Any]], ...] = ()  # (function, {path: expected})


def _t(box: str, kind: str, n: int, user: str, *expect: tuple[str, dict[str, Any]]) -> Task:
    return Task(f"{box}-{kind}-{n}", box, kind, user, tuple(expect))


W, T, C, B = "get_weather", "get_time", "convert_currency", "book_table"
E, EV, TD, Q = "send_email", "create_event", "add_todo", "search_web"
P, PZ, K, TR = "get_stock_price", "order_pizza", "calculate", "translate"

TASKS: list[Task] = [
    _t("travel", "single", 1, "What's the weather in Paris right now?", (W, {"city": "paris"})),
    _t("travel", "single", 2, "How hot is it in Tokyo? Give it to me in fahrenheit.",
       (W, {"city": "tokyo", "unit": "fahrenheit"})),
    _t("travel", "single", 3, "What time is it in London?", (T, {"zone": "london"})),
    _t("travel", "single", 4, "Tell me the current time in New York.", (T, {"zone": "york"})),
    _t("travel", "single", 5, "Convert 100 US dollars to euros.",
       (C, {"amount": 100, "from_currency": "usd", "to_currency": "eur"})),
    _t("travel", "single", 6, "How many Japanese yen is 250 GBP?",
       (C, {"amount": 250, "from_currency": "gbp", "to_currency": "jpy"})),
    _t("travel", "single", 7, "Is it raining in Cairo today?", (W, {"city": "cairo"})),
    _t("travel", "single", 8, "What's the local time in Sydney?", (T, {"zone": "sydney"})),
    _t("travel", "multi", 1, "What's the weather in Paris and in Rome?",
       (W, {"city": "paris"}), (W, {"city": "rome"})),
    _t("travel", "multi", 2, "What time is it in Tokyo, and what's the weather there?",
       (T, {"zone": "tokyo"}), (W, {"city": "tokyo"})),
    _t("travel", "multi", 3, "Convert 50 euros to US dollars and 50 euros to British pounds.",
       (C, {"amount": 50, "from_currency": "eur", "to_currency": "usd"}),
       (C, {"amount": 50, "from_currency": "eur", "to_currency": "gbp"})),
    _t("travel", "multi", 4, "I'm flying to Oslo: what's the weather and the local time there?",
       (W, {"city": "oslo"}), (T, {"zone": "oslo"})),
    _t("travel", "nested", 1, "Book a table at Luigi's at 19:00 for 2 adults and 1 child.",
       (B, {"restaurant": "luigi", "time": "19", "party.adults": 2, "party.children": 1})),
    _t("travel", "nested", 2, "Reserve a table for 4 adults at Sakura at 20:30.",
       (B, {"restaurant": "sakura", "time": "20", "party.adults": 4})),
    _t("travel", "nested", 3, "Get us a table at The Green Door, 18:00, three adults.",
       (B, {"restaurant": "green door", "time": "18", "party.adults": 3})),
    _t("travel", "nested", 4, "Book Noma at 12:00 for 2 adults and 2 children.",
       (B, {"restaurant": "noma", "time": "12", "party.adults": 2, "party.children": 2})),
    _t("travel", "none", 1, "Write a haiku about the sea."),
    _t("travel", "none", 2, "Explain what recursion is in one paragraph."),
    _t("travel", "none", 3, "Write a Python function that reverses a string."),
    _t("travel", "none", 4, "Who wrote Hamlet?"),
    _t("travel", "none", 5, "Give me three tips for packing a suitcase."),
    _t("travel", "none", 6, "Hello! How are you today?"),
    _t("office", "single", 1,
       "Email alice@example.com with the subject 'Lunch' and ask if she is free at noon.",
       (E, {"to": "alice@example.com", "subject": "lunch"})),
    _t("office", "single", 2, "Send bob@example.com an email saying the report is ready.",
       (E, {"to": "bob@example.com", "body": "report"})),
    _t("office", "single", 3, "Add 'buy milk' to my to-do list with high priority.",
       (TD, {"task": "milk", "priority": "high"})),
    _t("office", "single", 4, "Remind me to call the dentist; low priority.",
       (TD, {"task": "dentist", "priority": "low"})),
    _t("office", "single", 5, "Search the web for the latest Python release.",
       (Q, {"query": "python"})),
    _t("office", "single", 6, "Look up the best hiking trails in Norway online.",
       (Q, {"query": "norway"})),
    _t("office", "single", 7, "Put 'renew passport' on my to-do list, medium priority.",
       (TD, {"task": "passport", "priority": "medium"})),
    _t("office", "single", 8,
       "Email carol@example.com that the meeting moved to 3pm, subject 'Meeting'.",
       (E, {"to": "carol@example.com", "body": "3"})),
    _t("office", "multi", 1,
       "Email alice@example.com and bob@example.com, subject 'Party', saying the party is "
       "on Friday.",
       (E, {"to": "alice@example.com"}), (E, {"to": "bob@example.com"})),
    _t("office", "multi", 2, "Add two to-dos: 'buy bread' (high) and 'water the plants' (low).",
       (TD, {"task": "bread", "priority": "high"}), (TD, {"task": "plants", "priority": "low"})),
    _t("office", "multi", 3, "Search the web for cheap flights to Lisbon and add a to-do "
       "'book flights' with high priority.",
       (Q, {"query": "lisbon"}), (TD, {"task": "flight", "priority": "high"})),
    _t("office", "multi", 4, "Email dave@example.com, subject 'Invoice', that the invoice is "
       "attached, and add a medium-priority to-do to follow up with Dave.",
       (E, {"to": "dave@example.com"}), (TD, {"task": "dave", "priority": "medium"})),
    _t("office", "nested", 1, "Create an event 'Team sync' on 2025-03-14 at 10:00 with Alice "
       "(alice@example.com) and Bob (bob@example.com).",
       (EV, {"title": "sync", "start.date": "2025-03-14", "start.time": "10",
             "attendees[].name": ["alice", "bob"]})),
    _t("office", "nested", 2, "Schedule 'Project kickoff' for 2025-05-01 at 14:00 with Carol.",
       (EV, {"title": "kickoff", "start.date": "2025-05-01", "start.time": "14",
             "attendees[].name": ["carol"]})),
    _t("office", "nested", 3, "Put a 'Birthday party' in my calendar on 2025-06-20 at 18:00 "
       "and invite Dan and Eve.",
       (EV, {"title": "birthday", "start.date": "2025-06-20", "start.time": "18",
             "attendees[].name": ["dan", "eve"]})),
    _t("office", "nested", 4, "Create a calendar event 'Design review' on 2025-07-08 at 09:30 "
       "with Frank (frank@example.com).",
       (EV, {"title": "design", "start.date": "2025-07-08", "start.time": "09",
             "attendees[].name": ["frank"]})),
    _t("office", "none", 1, "Write a limerick about a cat."),
    _t("office", "none", 2, "What is the difference between a list and a tuple in Python?"),
    _t("office", "none", 3, "Summarize the plot of Romeo and Juliet in one sentence."),
    _t("office", "none", 4, "What does HTTP stand for?"),
    _t("office", "none", 5, "Suggest a name for a pet goldfish."),
    _t("shop", "single", 1, "What's Apple's stock price? The ticker is AAPL.",
       (P, {"symbol": "aapl"})),
    _t("shop", "single", 2, "Get me the latest price of MSFT.", (P, {"symbol": "msft"})),
    _t("shop", "single", 3, "Calculate 17 * 23.", (K, {"expression": "17"})),
    _t("shop", "single", 4, "What is (45 + 55) / 4? Use the calculator.",
       (K, {"expression": "45"})),
    _t("shop", "single", 5, "Translate 'thank you' into French.",
       (TR, {"text": "thank you", "target_language": "fr"})),
    _t("shop", "single", 6, "How do you say 'where is the station' in German? Translate it.",
       (TR, {"text": "station", "target_language": "german"})),
    _t("shop", "single", 7, "What is NVIDIA trading at? Its ticker is NVDA.",
       (P, {"symbol": "nvda"})),
    _t("shop", "single", 8, "Translate 'good night' to Italian.",
       (TR, {"text": "good night", "target_language": "ital"})),
    _t("shop", "multi", 1, "Get the stock prices of AAPL and GOOGL.",
       (P, {"symbol": "aapl"}), (P, {"symbol": "googl"})),
    _t("shop", "multi", 2, "Translate 'hello' into French and into Spanish.",
       (TR, {"text": "hello", "target_language": "fr"}),
       (TR, {"text": "hello", "target_language": "spa"})),
    _t("shop", "multi", 3, "Calculate 2 ** 10 and get the stock price of TSLA.",
       (K, {"expression": "10"}), (P, {"symbol": "tsla"})),
    _t("shop", "multi", 4, "What is AMZN trading at, and what is 3.5 * 8?",
       (P, {"symbol": "amzn"}), (K, {"expression": "3.5"})),
    _t("shop", "nested", 1, "Order 2 large margherita pizzas to 12 Main St, Springfield.",
       (PZ, {"items[].name": ["margherita"], "items[].size": ["large"],
             "items[].quantity": [2], "address.street": "main", "address.city": "springfield"})),
    _t("shop", "nested", 2, "Order one small pepperoni and one medium hawaiian pizza, "
       "delivered to 5 Oak Ave, Portland.",
       (PZ, {"items[].name": ["pepperoni", "hawaiian"], "items[].size": ["small", "medium"],
             "address.street": "oak", "address.city": "portland"})),
    _t("shop", "nested", 3, "Deliver 3 medium veggie pizzas to 221B Baker Street, London.",
       (PZ, {"items[].name": ["veg"], "items[].quantity": [3], "items[].size": ["medium"],
             "address.street": "baker", "address.city": "london"})),
    _t("shop", "nested", 4, "I'd like a large quattro formaggi pizza sent to 9 Elm Road, Austin.",
       (PZ, {"items[].name": ["formaggi"], "items[].size": ["large"],
             "address.street": "elm", "address.city": "austin"})),
    _t("shop", "none", 1, "Write a short poem about autumn."),
    _t("shop", "none", 2, "Explain what an API is in two sentences."),
    _t("shop", "none", 3, "What is the tallest mountain in the world?"),
    _t("shop", "none", 4, "Write a SQL query that selects every row of a table named users."),
    _t("shop", "none", 5, "Tell me a joke about programmers."),
]  # fmt: skip


def _values(arguments: Any, path: str) -> list[Any]:
    """The values at ``path`` (``a.b``; ``a[].b``: b of every item of list a)."""
    found = [arguments]
    for part in path.split("."):
        each = part.endswith("[]")
        key = part.removesuffix("[]")
        nxt = []
        for value in found:
            value = value.get(key) if isinstance(value, dict) else None
            if each:
                nxt += value if isinstance(value, list) else []
            elif value is not None:
                nxt.append(value)
        found = nxt
    return found


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(expected, str):
        return isinstance(actual, str) and expected.lower() in actual.lower()
    if isinstance(expected, bool) or isinstance(actual, bool):
        return expected is actual
    return isinstance(actual, (int, float)) and float(actual) == float(expected)


def _checks(checks: dict[str, Any], arguments: dict[str, Any]) -> bool:
    """Every check holds: a scalar at the path; a list: each expected found among the items."""
    for path, expected in checks.items():
        values = _values(arguments, path)
        wanted = expected if isinstance(expected, list) else [expected]
        if not all(any(_same(w, v) for v in values) for w in wanted):
            return False
    return True


def matches(task: Task, calls: list[tuple[str, dict[str, Any]]]) -> tuple[bool, bool]:
    """(the functions called are the expected ones, as a multiset; and, pairing each
    expected call with one actual call, every argument check holds)."""
    names = sorted(n for n, _ in calls)
    if names != sorted(n for n, _ in task.expect):
        return False, False
    for order in permutations(calls):
        if all(
            n == en and _checks(ec, a) for (n, a), (en, ec) in zip(order, task.expect, strict=True)
        ):
            return True, True
    return True, False


_RESULTS = {
    "get_weather": lambda a: {"city": a.get("city"), "temperature_c": 18, "conditions": "cloudy"},
    "get_time": lambda a: {"zone": a.get("zone"), "time": "14:05"},
    "convert_currency": lambda a: {"amount": a.get("amount"), "converted": 91.2,
                                   "currency": a.get("to_currency")},
    "book_table": lambda a: {"booked": True, "confirmation": "BK-2041"},
    "send_email": lambda a: {"sent": True},
    "create_event": lambda a: {"created": True, "event_id": "EV-77"},
    "add_todo": lambda a: {"added": True, "id": 12},
    "search_web": lambda a: {"results": [f"A page about {a.get('query')}"]},
    "get_stock_price": lambda a: {"symbol": a.get("symbol"), "price": 187.42, "currency": "USD"},
    "order_pizza": lambda a: {"ordered": True, "eta_minutes": 35},
    "calculate": lambda a: {"result": 391},
    "translate": lambda a: {"translation": "merci"},
}  # fmt: skip


def fake_result(name: str, arguments: dict[str, Any]) -> str:
    """A made-up result of ``name`` called with ``arguments``, as JSON text."""
    return json.dumps(_RESULTS[name](arguments))
