"""The judges: what scores a turn from the state that followed it, and what writes its hint.

One concept per module, imported from the module that owns it (this package re-exports nothing):

- `prompts`: the PRM and hint rubrics and the chats the LLM judges are asked.
- `votes`: reading a vote (thinking, `\\boxed{}`, truncation), the majority, the hint of the
  votes, the timed verdict and hint every judge returns, and the `Judge` protocol.
- `llm`: the LLM judges, `GenerateJudge` (the seed's PRM, m sampled votes) and `VerdictJudge`
  (one forward, votes drawn from the verdict-token probabilities).
- `classifier`: all-MiniLM-L6-v2 fine-tuned as a classifier of the next state: the text it reads,
  its fit on the shipped labelled cases.
- `ngrams`: a linear model over hashed character and word n-grams of the same text.
- `fitted`: what those readers share: the `Reader` protocol and the cache of their fitted weights.
- `committee`: the readers the judge averages (those two, weighted) and how they are combined.
- `cues`: the textual cues the decision rule reads (failure signs, edit and redo words, emoji names).
- `embed`: `EmbedJudge`, the CPU default: that committee and the decision rule over it.
- `hints`: the hint judges for --method opd|combine, `GenerateHintJudge` and `EmbedHintJudge`.
- `completers`: an engine of ours or an OpenAI-compatible endpoint as an LLM judge's model call.
- `cases`: labelled cases and a judge's accuracy on them.

Nothing here knows of sessions, HTTP or training; the daemon picks and builds the judge.
"""
