"""The short chat prompts the serving, refusal, cluster and training benchmarks send: one-line
questions with one-line answers, so a run measures the machinery, not long generations."""

PROMPTS = [
    "What is 2+3?",
    "Name a fruit.",
    "What colour is the sky?",
    "Say hello in French.",
    "What is the capital of Italy?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is 10 minus 4?",
]
