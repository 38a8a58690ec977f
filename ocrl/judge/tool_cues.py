"""Cheap textual cues in a tool's output that the embed judge's decision rule (`decide` in
embed.py) reads beside the classifier: a sign that the call failed (`tool_failure`: scored -1)
and a sign that it reports no outcome yet (`tool_no_verdict`: a pending job or an empty result,
scored 0). Each returns the matched text on one line, or None, and knows nothing of the
classifier, its fit or the rule. The cues in user messages are in cues.py.
"""

from __future__ import annotations

import re

# Cheap evidence of a failed tool call: a tool message that shows one is scored -1 (an error
# read as success would train the policy the wrong way). Written from the kinds of failure
# that tools print, by ecosystem, not from any case a judge missed (but gpg's "BAD signature",
# added when the spent tenth held-out set showed it missing, and SBCL's debugger, and the
# "read-only space" of a saved Lisp image that is no failure, from the spent twenty-second):
_FAILURE_CUES = (
    # runtimes: exception names, tracebacks and stack frames (Python, Java, Node), panics (Go, Rust)
    r"Traceback \(most recent call last\)|(?<!\b0 )\b(?!\w*NoError\b)\w*(?:Error|Exception)\b|\w+Timeout\b"
    r"|(?i:\bpanic:)|\bpanicked\b|\bgoroutine \d+ \[|(?m:^\s+at [\w$.<>]+ ?\(.*:\d+\)?\)?\s*$)",
    # words that report a failure, and exit codes (bare, or as JSON fields an agent's tool wraps them in)
    r"(?<!\b0 )(?<!\b[Nn]o )\b(?i:errors?|err!)(?![\w-]|\.\w)(?!\"?\s*[:=]\s*(?:null|\[\]|\{\}|\"\"|false|0\b))"
    r"|(?i:\b(?:exit(?:ed)?(?: with)?(?: code| status)?|non-zero exit status|returned non-zero(?: exit)?(?: status)?)\s*:?\s*[1-9])"
    r"|(?i:\b(?:rc|exit|exit_?code|exit_?status|return_?code|returncode)\"?\s*[=:]\s*\"?[1-9])|(?i:\btimed_?out\"?\s*[=:]\s*true\b)"
    # a shell's exit status echoed after the command ("$ echo $?" then a number that is not 0: all 20 labelled are failures)
    r"|(?m:^\$ echo \"?(?:exit=|rc=|status=)?\$\?\"?[^\n]*\n\s*(?:exit=|rc=|status=)?[1-9]\d*\s*$)"
    # a line that opens with an apology ("Sorry, there is a problem", "Unfortunately ..."): all 6
    # distinct labelled tool outputs with one report a failure ("Sorry, Tuesday 9:00 was booked by
    # someone else"); inside a line it may be quoted text (a mail's subject), so it is left there
    r"|(?im:^\W*(?:sorry|unfortunately|we're sorry|we are sorry|apologies|oops)\b)"
    # a cross mark opening a line, beside an item ("✘ circles_rust_01.jpg", "✖ Modafinil ... not supplied"),
    # not a count ("✗ 0", k6's "✗ 2400" of requests that did not fail, eslint's "✖ 2 problems (0 errors,
    # 2 warnings)"): all 24 distinct labelled tool outputs with ✘, ✗ or ❌ so are failures, and all 11 with ✖
    r"|(?m:^[^\w\n]*[✘✗❌✖](?!\s*\d))"
    # a line of an order or a batch taken out, with its reason, inside a body that succeeded
    r"|(?i:\[\s*\{[^\]]*?\"status\"\s*:\s*\"(?:cancel+ed|removed|rejected|refused|unavailable|out_of_stock)\"[^\]]*?\"reason\")"
    r"|(?i:\"(?:\w+_)?(?:status|state|result|outcome)\"\s*:\s*\"(?:failed|failure|error|errored|timed_?out|timeout|offline|unreachable|rejected"
    r"|denied|returned|bounced|recalled|reversed|invalid(?:_\w+)?|undeliver(?:ed|able)|expired|not_?found|partial(?:ly)?(?:_\w+)?|owing"
    r"|back_?order(?:ed)?|out_of_stock)\")"
    r"|(?i:\bstatus:\s*(?:returned|bounced|recalled|reversed)\b|\breturned\s+[-\u2013\u2014]\s+(?!\d))"
    r"|\bfatal:|\bFATAL\b|\bFAILED\b|\bFAILURE\b|\bKilled\b|\b[1-9]\d* failed\b|\b(?:CrashLoop|ImagePull)BackOff\b|\bErrImagePull\b|\bOOMKilled\b"
    r"|(?i:(?<!(?<![=:])\b0 )\bfailed\b(?![:=]?\s*0\b)|(?<!(?<![=:])\b0 )(?<!\b[Nn]o )\bfailures?\b(?![:=]?\s*0\b)|\baborted\b|\bcrashed\b|\brejected\b|\bdeclined\b|\binsufficient\b|\bgiving up\b|\bgave up\b|\bunable to\b"
    r"|\bcould not\b|\bcouldn't\b|\bcannot\b|\bcan't\b|\binvalid\b|\bunknown (?:command|option|host|user)\b|\bunsupported\b)"
    r"|(?i:\bsegmentation fault\b|\bcore dumped\b|\bno space left\b|\bno free space\b|\bout of memory\b|\bunavailable\b|\bnot available\b|\bmismatch\b|(?<!\b0 )\bdegraded\b"
    r"|\bunrecognized\b|\bunresolved\b|\bunexpected\b|\brolled back\b|\brevoked\b|\brestricted\b|\bread-only\b(?! (?:space|section|segment|region)\b)|\bview-only\b|(?<!\b0 )(?<!\b[Nn]o )\bbroke(?:n)?\b"
    r"|\b(?:is|are) required\b|\balready (?:taken|booked|in use)\b|\bis not (?:a )?(?:valid|real|defined|supported)\b"
    r"|\b(?:was|were) not (?:sent|saved|added|created|written|delivered|applied|published|uploaded|deleted|updated|imported|copied|moved)\b"
    r"|\b(?:has|have) not been (?:sent|saved|submitted|processed|accepted|approved|booked)\b"
    r"|\bno (?:booking|order|reservation|payment|appointment|purchase) (?:(?:has|have) been|was|were) (?:made|placed|taken|booked)\b"
    r"|\bnothing was (?:sent|saved|added|created|written|delivered|imported|copied|moved)\b|\bonly (?:the )?(?:\w+ ){0,2}(?:owners?|admins?|administrators?|members?) can\b)"
    r"|\bdebugger invoked on\b|(?i:\bis unbound\b)"  # a Lisp condition that stops in the debugger
    # a printer stopped by a fault (CUPS: "printer X disabled since ..."; a paper jam)
    r"|\bprinter \S+ disabled since\b|(?i:\bpaper jam\b|\bjammed\b)"
    # a monitor's alert opening a line, in capitals ("ALERT Chest freezer -6.2 °C (threshold -15 °C)")
    r"|(?m:^\W*ALERT\b)"
    # an error-level line of an ESP-IDF log ("E (7210) task_wdt: Task watchdog got triggered")
    r"|(?m:^E \(\d+\) [\w-]+:)"
    # a form's error summary ("There is a problem" over the fields to fix), a spreadsheet's error values
    r"|(?im:^\W*there (?:is|was) a problem\b)|#(?:DIV/0!|REF!|VALUE!|NAME\?|NUM!|NULL!|N/A\b)"
    # entries, bookings or sales closed, a deadline gone ("Entries closed: the deadline ... was 31 March")
    r"|(?i:\b(?:entries|entry|registrations?|applications?|bookings?|enrol?lments?|sales|submissions?|sign-?ups?|nominations?)"
    r"\s+(?:are |is |have |has )?(?:now )?closed\b|\bdeadline\b[^\n.]{0,40}\b(?:has|have) passed\b)"
    # the commonest words for "failed" in other languages (a mobile-money SMS, a localised CLI)
    r"|(?i:\b(?:falhou|falló|échoué|fehlgeschlagen|mislukt|misslyckades|mislyktes|epäonnistui|başarısız|sikertelen|selhalo)\b|失败|失敗|실패|не удалось)"
    # ... and for "error" opening a line ("Erreur : le nombre maximal ...", "Fehler: ...")
    r"|(?im:^\W*(?:erreur|fehler|errore|erro|fout|feil|virhe|hiba|błąd|chyba|greška|hata|ошибка|помилка|грешка)\s*:)"
    r"|\bFAIL\b|\bSSL_ERROR_\w+|(?m:^\S+\.go:\d+:\d+: )|(?i:\bbad signature\b)|(?i:(?<!\b0 )(?<!\bnot )(?<!\bnever )\bexpired\b)",
    # scanners that found something: vulnerabilities (osv-scanner, npm audit, pip-audit, grype), malware
    # (ClamAV's "<file>: <signature> FOUND", "Infected files: 1"), secrets (trufflehog, gitleaks)
    r"(?i:\b[1-9]\d* (?:known )?vulnerabilit(?:y|ies)\b)|(?m::\s+\S[^\n]*\sFOUND\s*$)|(?i:\binfected files:\s*[1-9])"
    r"|(?i:\bfound (?:un)?verified result\b|\bleaks found:\s*[1-9])|(?i:\bfound [1-9]\d* (?:\w+ )?(?:issues?|problems?|violations?|vulnerable paths?)\b)"
    # a static analyzer's count of findings (Slither: "analyzed (3 contracts ...), 1 result(s) found")
    r"|(?i:\banalyzed\b[^\n]{0,120}?\b[1-9]\d* results?(?:\(s\))? found)",
    # formatters and linters run as a check: files they would change (black, ruff format, prettier)
    r"(?i:\b[1-9]\d* files? would be reformatted\b|\bwould reformat\b|\bcode style issues found\b)",
    # build tools: make's "***" lines, cargo/rustc/tsc/gcc error codes, a failed build
    r"(?m:^\s*(?:g?make|ninja)(?:\[\d+\])?: \*\*\*)|\berror\[E\d+\]|\berror TS\d+|(?i:\bbuild failed\b|\bcompilation terminated\b)",
    # not found, missing
    r"(?i:\bcommand not found\b|\bno such\b|\bnot found\b|\bdoes ?n[o']t exist\b|\bno longer exists\b|\bnot recognized as\b"
    r"|\bno \w+ to satisfy\b|\bnothing provides\b|\bno matching (?:versions?|distributions?|packages?)\b"
    r"|\bno [\w./-]+\.(?:spec|json|toml|ya?ml|lock|cfg|ini|conf|config|xml|gradle|properties|env|pem|key)(?: file)? (?:was )?found\b"
    # no device to run on ("No P-Touch printer found on USB", "no camera detected")
    r"|\bno (?:[\w-]+ ){0,2}(?:printers?|devices?|cameras?|scanners?|drives?|disks?|adapters?|interfaces?|controllers?|displays?|monitors?"
    r"|microphones?|speakers?|readers?|boards?|sensors?|dongles?|gpus?|cards?) (?:was |were )?(?:found|detected|connected|attached)\b"
    r"|\bno (?:task|issue|ticket|item|record|user|order|job|entry|file|page|project|contact|note|event|invoice|booking|message|parcel"
    r"|container|instance|run|build|pipeline|snapshot|package|app|device|model) (?:#|no\. ?|number |with id |id )?[\w-]*\d[\w-]*\b)",
    # permission and authentication
    r"(?i:\bpermission denied\b|\baccess (?:is )?denied\b|\bdenied\b|\bforbidden\b|\bunauthori[sz]ed\b|\bnot (?:allowed|permitted|authori[sz]ed)\b"
    r"|\b(?:need|needs|require|requires|don't have|do not have|doesn't have|does not have|lack|lacks|insufficient|missing)"
    r" (?:the |an? )?(?:\w+ )?(?:permissions?|access|rights|privileges?|roles?|scopes?)\b"
    r"|\bauthentication (?:failed|required)\b|\bauthenticationfailed\b|\blogin required\b|\bsession (?:has )?expired\b|\btoken (?:has )?expired\b)"
    r"|\bE(?:ACCES|PERM|NOENT|EXIST|ISDIR|NOTDIR|ROFS|NOSPC|MFILE|CONNREFUSED|CONNRESET|CONNABORTED|TIMEDOUT|HOSTUNREACH|NETUNREACH|NOTFOUND|AI_AGAIN|PIPE|ADDRINUSE)\b",
    # network: refused/reset connections, DNS, TLS
    r"(?i:\b(?:device|host|server|node|printer|sensor|camera|service|agent|runner|worker|peer|gateway|hub|instance|machine|client)"
    r" (?:is |went |appears |seems )?offline\b)|(?i:\brefused\b|\breset by peer\b|\bconnection (?:reset|closed|aborted|lost)\b|\bbroken pipe\b|\bunreachable\b(?![:=]\s*0\b)|\bno route to host\b"
    r"|\bnxdomain\b|\bservfail\b|\bname or service not known\b|\bname resolution\b|\bcould not resolve\b"
    r"|\bcertificate (?:has )?expired\b|\bself[- ]signed certificate\b|\bcertificate problem\b|\bunknown authority\b|\bhandshake (?:failure|failed)\b)",
    # quotas, limits ("too many", "clock skew too great": all 33 labelled tool outputs with one are failures), rate limits, timeouts
    r"(?i:\bexceeded\b|\btoo (?:great|large|big|many|long|old|new|short|small|slow|high|low|much)\b|\brate[- _]?limited\b|\brate[- _]?limit (?:reached|hit)\b|\btoo many requests\b|\bthrottl(?:ed|ing)\b|\bquota\b[^.\n]{0,30}\b(?:reached|full|used up)\b"
    r"|\bout[_ ]of[_ ]stock\b|\blimit (?:reached|hit)\b|\btry again (?:later|in)\b|\btimed out\b|\btimeout (?:after|for|error|exceeded|expired)\b"
    r"|(?im:^\s*time ?out\b(?!\s*(?:[=:]|(?:is|set|of|to)\b)))"
    r"|\bdid not (?:finish|complete|respond|return)\b|\bno response from\b|\bwithout (?:a )?response\b|(?<!\b0 )(?<!\b[Nn]o )\bconflicts?\b)",
    # nothing left to book: "fully booked", "sold out", "no seats left", "Places left: 0"
    r"(?i:\bfully booked\b|\bsold out\b|\bno (?:more )?(?:places|seats|spaces|spots|slots|tickets|rooms|tables|availability)"
    r" (?:left|available|remaining)\b|\b(?:places|seats|spaces|spots|slots|tickets|rooms|tables) (?:left|available|remaining):\s*0\b)",
    # a delivery that did not reach its address ("Returned to depot", "Delivery attempted - no safe place")
    r"(?i:\breturned to (?:the )?(?:sender|depot|origin|warehouse|branch)\b|\bdelivery (?:attempted|unsuccessful)\b|\battempted delivery\b|\bundeliverable\b)",
    # a list of what was rejected or failed that is not empty, inside a body that succeeded ("items_rejected": [{...}])
    r"(?i:\"(?:\w+_)?(?:rejected|failed|declined|refused|cancel+ed|unavailable)(?:_\w+)?\"\s*:\s*\[\s*[{\"])",
    # protocols: HTTP status lines and reason phrases, status fields, SMTP replies with enhanced codes, IMAP NO/BAD
    r"(?m:^\s*(?:HTTP/[\d.]+\s+|SMTP\s+)?[45]\d\d(?:\s+|\s*[-:]\s*)[A-Z])|\bHTTP/[\d.]+ [45]\d\d\b|\b[45]\d\d[ -][45]\.\d{1,3}\.\d{1,3}\b"
    r"|\b(?:Bad Request|Payment Required|Method Not Allowed|Not Acceptable|Request Timeout|Precondition Failed|Payload Too Large"
    r"|Unsupported Media Type|Unprocessable (?:Entity|Content)|Too Many Requests|Internal Server Error|Not Implemented|Bad Gateway"
    r"|Service Unavailable|Gateway Timeout)\b"
    r"|(?i:\b(?:status(?:[ _]?code)?|http[ _]?status|code)\"?\s*[=:]?\s*\"?[45]\d\d\b)|(?i:\"(?:ok|success|succeeded)\"\s*:\s*false)"
    r"|\bHTTP:? [45]\d\d\b|(?m:^\w+ (?:NO|BAD) |^-ERR\b)",
)
_TOOL_FAILURE = re.compile("|".join(f"(?:{cue})" for cue in _FAILURE_CUES))


# An echoed command line ("$ grep -n 'fail' app.log"): its own words are no sign of failure
# ("--error-exitcode=1"), nor, when it searches, are the words it searched for in its output.
_COMMAND = re.compile(r"\A\s*(?:\$|>|❯|PS [^>\n]*>) (?=\S)([^\n]*)")  # a shell's prompt: sh, nushell or cmd, PowerShell
_SEARCHING = re.compile(r"(?i:\b(?:grep|egrep|rg|ug|ag|ack|findstr|select-string|search|query|filter)\b)")


def tool_failure(text: str) -> str | None:
    """The first sign of a failed tool call in its output, or None. A count of failures that is
    zero is no sign: "0 tests failed", "Errors 0", "failed | 0", "Failed files: 0",
    "ERROR SUMMARY: 0 errors", `"failures": []`; nor is the echoed command, or a word that
    command searched for ("$ mlflow runs list | grep FAILED")."""
    command = _COMMAND.match(text)
    searched = set()
    if command is not None and _SEARCHING.search(command.group(1)):
        searched = {word.lower() for word in re.findall(r"[A-Za-z]{4,}", command.group(1))}
    for match in _TOOL_FAILURE.finditer(text):
        if command is not None and match.start() < command.end():
            continue
        word = match.group(0).strip().lower()
        if word.isalpha() and any(word.startswith(term) for term in searched):
            continue
        if _REMOVED_BEFORE.search(text[max(0, match.start() - 40) : match.start()]):
            continue
        if word.startswith("connection closed") and _SESSION_ENDED.search(text[: match.start()]):
            continue
        if not _zero_count(text, match):
            return " ".join(match.group(0).split())  # one line: "$ echo $?\n1" -> "$ echo $? 1"
    return None


# what a clean-up removed is no failure of it: "Purged 1284 expired sessions", "removed 3 failed jobs"
_REMOVED_BEFORE = re.compile(r"(?i:\b(?:purged|removed|deleted|cleaned up|cleared|pruned|evicted|archived) [\d,]+ $)")
# a connection closed after the client ended the session (SMTP's QUIT answered "221 ... Bye")
_SESSION_ENDED = re.compile(r"\bQUIT\b[\s\S]*\b221\b")
_COUNTED = re.compile(r"(?i:errors|failed|failures?|fails?|rejected|declined|conflicts?|unavailable|out[_ ]of[_ ]stock)")
_ZERO_AFTER = re.compile(r"(?i:\s*(?:summary|count|total|[a-z]+(?=\s*[:=|]))?(?:\W{0,4}|[\s:.]{5,80})\s*(?:0|\[\]|\{\}|none|null|no(?=[ \t]*(?:\n|$))|no (?:\w+ ){0,2}(?:errors?|failures?)\b)(?![\w%]|[.,]\d))")
# "0" or "no" up to three words before the word ("No ESLint warnings or errors")
_ZERO_BEFORE = re.compile(r"(?i:\b(?:0|no) (?:[a-z]+ ){1,3}$)")
_SUMMARY_HEAD = re.compile(r"(?i:\s+(?:summary|count|total)\b)")


_ZERO_JUST_BEFORE = re.compile(r"(?:^|[\s(\[])0 $")


def _zero_count(text: str, match: re.Match[str]) -> bool:
    """Whether a failure word is the label of a count that is zero (the word then a 0, or an
    empty list; "0" and a word or two before it; any failure word right after a "0": "(0
    unexpected)") or the head of a summary of one."""
    after = text[match.end() : match.end() + 96]
    counted = _COUNTED.fullmatch(match.group(0).strip()) is not None
    if (counted or _SUMMARY_HEAD.match(after)) and _ZERO_AFTER.match(after):
        return True
    if match.group(0).isalpha() and _ZERO_JUST_BEFORE.search(text[max(0, match.start() - 4) : match.start()]):
        return True
    return counted and _ZERO_BEFORE.search(text[max(0, match.start() - 30) : match.start()]) is not None


# Tool output that reports no verdict yet is 0, not +1 (the label rule of every held-out set: "queued,
# pending, in progress, a job id, empty output, or an empty result"; a search that ran and found
# nothing neither confirms nor refutes the turn). Read only when no failure shows. Written from the
# states and empty shapes that tools print; the twentieth candidate read 31 of the 116 such outputs
# in the six spent held-out sets (5, 12, 14-17) as success. Left out on purpose, each seen in
# labelled successes: "Started"/"Running" at the head of a line (containers, test runners,
# servers), "0 issues"/"no problems found" (a checker's pass), a "state": "open" (a listing of pull
# requests), "%" alone (disk use, ping loss, compression).
# Progress verbs such as "Scanning"/"Converting" beside a percentage are left out too (a type
# checker's coverage, an e-book converter that finished); "sending", "Request accepted" and "is
# being created" came with the spent twenty-second set, no labelled outcome carries them.
# "submitted" and "accepted" as a state are left out since the spent twenty-seventh set: 7 of the
# 10 labelled are outcomes (a form handed in, a talk accepted, a payment's fraud check passed).
_PENDING = (
    r"pending|queued|in[ _-]?progress|processing|awaiting|waiting for\b|scheduled|in[ _]transit|pre_transit"
    r"|requested|starting|running|not_started|provisioning|building|deploying|initiali[sz]ing|enqueued"
    r"|preparing|syncing|printing|downloading|uploading|copying|sending|in[ _]review|under[ _]review|waitlisted"
)
_EMPTY_LISTS = r"items|results?|matches|hits|records|rows|events|entries|contacts|documents|docs|objects|invoices|orders|tasks|content|data|list|value"
_ZERO_TOTALS = r"total|count|total_?count|totalResults|totalElements|total_results|resultCount|result_count|hits|num_?found|numFound|matches"
_FOUND_NOUNS = (
    r"results?|matches|hits|entries|items|records|events|contacts|messages|conversations|documents|snapshots|tasks|tickets"
    r"|orders|bookings|appointments|flights|emails|notes|posts|users|objects|jobs|containers|pods|products|listings|rooms|slots"
)
# a command that checks and prints nothing when all is well: linters, formatters in check mode, type checkers
_CHECKER = r"(?i:--check\b|--lint\w*|--noEmit\b|\b(?:lint|\w+lint|shellcheck|mypy|ruff|flake8|clippy|tsc|vet|validate|verify)\b)"
_NO_VERDICT_CUES = (
    # a job's state that is no outcome yet: a status field, a sentence, a column in capitals
    rf"(?i:\"?(?:status|state|phase|stage|job_?status|job_?state|\w+_status|\w+Status)\"?\s*[:=]\s*\"?(?:{_PENDING})\b)",
    rf"(?i:\b(?:status|state)\s*[:=]?\s+(?:is\s+)?[\"']?(?:{_PENDING})\b)",
    r"(?i:\bis (?:now )?(?:pending|queued|processing|in progress|scheduled)\b)|\bin progress\b"
    # a job that is running (a service that is running has started: "Horizon is running.")
    r"|(?i:\b(?:job|pipeline|build|task|run|operation|export|import|backup|migration|deployment|workflow|sync|scan|query|process|upload|download)\b"
    r"[^\n.]{0,40}?\bis (?:now |still )?running\b)"
    # a state in capitals, unless a later line of the log reads it done ("... RUNNING", then "... DONE")
    r"|\b(?:IN_PROGRESS|RUNNING|PENDING|QUEUED)\b(?![\s\S]*\b(?:DONE|SUCCESS|SUCCEEDED|COMPLETED|FINISHED|PASSED)\b)",
    r"(?i:\"\w*(?:running|pending|processing|queued|in_?progress)\"\s*:\s*true\b)",
    # any field of a job or request still waiting ("Refund: pending (5-7 working days)", "drainage_water": "requested")
    r"(?im:(?:^\s*|[.;]\s+)[a-z][\w ]{0,30}:\s*(?:pending|queued|awaiting|not yet (?:available|arranged|scheduled|assigned|booked|confirmed|known|decided)))|(?i:\"\w+\"\s*:\s*\"(?:pending|queued|requested|in_progress|awaiting\w*)\")",
    r"(?i:\b(?:has been|was|(?<!not )been) (?:queued|scheduled|submitted|accepted|received)\b|\brequest accepted\b"
    r"|\bis being (?:created|provisioned|processed|deployed|built|prepared|uploaded|sent|restored|migrated|generated|indexed|imported|exported)\b|\bstill (?:creating|running|waiting|processing|building|pending|in progress)\b)",
    # a message handed on to someone who has yet to answer ("your enquiry has been passed to a
    # surveyor", "we aim to reply within 10 working days", "this can take up to 45 days")
    r"(?i:\b(?:has been|will be|was) passed (?:on )?to\b|\baims? to (?:reply|respond)\b|\bcan take up to \d)",
    # an automatic reply: the person has not read it yet ("Auto-reply: ... I am away until 12 November")
    r"(?i:\bauto-?repl(?:y|ied)\b|\bautomatic reply\b|\bi am (?:currently )?away\b|\bout of (?:the )?office until\b)",
    # a job handed over: accepted (HTTP 202), queued, scheduled, started or triggered
    r"\bHTTP/[\d.]+ 202\b|\"StatusCode\":\s*202\b|\b202 Accepted\b|(?i:\bbackground (?:saving|save|job|task|sync) started\b)",
    r"(?i:\b(?:job|jobs|deployment|task|build|export|request|message|run|operation)\b[^\n.]{0,30}?\b(?:queued|enqueued|scheduled|submitted)\b"
    r"|\badded to (?:the )?queue\b|\bposition in queue\b|^queued\b|\bQueued\.|\bscheduled for\b)",
    r"(?i:\b(?:job|execution|run|build|task|operation)\b[^\n.]{0,40}?\bhas started\b|\bexecution started\b"
    r"|\b(?:deploy|deployment|build|run|workflow|pipeline|job)s? triggered\b)",
    # empty results: empty lists and zero totals (JSON, headers), "0 results", "no matches", a bare []
    rf"(?i:\"(?:{_EMPTY_LISTS})\"\s*:\s*\[\s*\])|(?i:\"(?:{_ZERO_TOTALS})\"\s*:\s*0(?![\d.]))",
    r"(?i:\bx-[\w-]*total[\w-]*:\s*0\b|\bcontent-range:\s*\*/0\b|\"count\"\s*:\s*\"0\")",
    r"(?i:\b0 (?:results?|matches|hits|items|records|conversations|messages|contacts|entries|documents|events|objects)\b"
    r"|\b0 of \d+ \w+ shown\b|\b0 rows in set\b|\(0 rows\))",
    # "0 claims found", "0 users matched": but a checker's "0 problems found" has passed
    r"(?i:\b0 (?!(?:errors?|problems?|issues?|warnings?|vulnerabilit\w*|differences?|discrepanc\w*|conflicts?|failures?|violations?"
    r"|defects?|bugs?|leaks?|alerts?|findings?|threats?|infections?|malware|viruses)\b)[a-z]+ (?:found|matched)\b)",
    rf"(?i:\bno (?:\w+ ){{0,2}}?(?:{_FOUND_NOUNS})(?: \w+){{0,2}}? (?:found|matched|match|matching|available|yet)\b"
    r"|\bfound no (?!issues|problems|errors|warnings|vulnerabilit|differences|discrepancies)|\bnothing (?:on (?:your|the)\b|found|to show|matched|scheduled)"
    r"|\bempty set\b|\bis empty\b|\(empty[\w ]*\)|\bno new \w+|^\s*no (?:results|matches|hits|entries|items|records|events)\b)",
    r"(?i:\bno [\w -]{1,40}? (?:found|(?:are |is )?available) (?:within \d|in your area\b))",
    r"(?i:\bno (?:\w+ ){0,3}match(?:es)? your search\b|^\W*(?:\$ [^\n]*\n)?no (?:matches|results)\b|\bno resources found\b)",
    # empty output: nothing at all, an empty stdout, a command echoed with only its exit status 0 after it
    r"^\s*(?:\[\s*\]|\{\s*\}|null|\(no (?:stdout|output)\))\s*$|(?:^|\s)\[\s*\]\s*$|(?m:^\W*empty list\W*$)",
    # (not a checker's: one that prints nothing and exits 0 has passed, "$ cargo fmt --check")
    rf"\A\$ (?![^\n]*{_CHECKER})[^\n]*\n\$ echo [^\n]*\n?\s*(?:exit=)?0\s*\Z|(?i:\"?stdout\"?\s*:\s*(?:\"\"|\n|\s+\"?stderr))",
    # a search that counts its matches and found none ("$ grep -c ERROR app.log", then "0")
    r"\A\$ (?:grep|egrep|rg|zgrep)\b[^\n]*\s-\w*c\b[^\n]*\n\s*0\s*\Z",
    # a command sent to the background, with only its job number and process id after it
    r"\A\$ [^\n]*&\s*\n\[\d+\] \d+\s*\Z",
    # output that stops on a line of work still under way ("Compiling glam v0.27.0", "Downloading
    # matplotlib-3.9.0 ...", "Fetching https://..."): all 18 distinct labelled tool outputs whose last
    # line opens so are no outcome yet
    r"(?im:^[ \t]*(?:compiling|downloading|fetching|uploading|collecting|building|installing|resolving|deploying|pushing"
    r"|pulling)\b(?![^\n]*\b(?:done|ok|finished|complete)\b)[^\n]*\s*\Z)",
    # an empty data frame (R's tibble, a polars frame), a job not waited for or waiting until a time
    r"(?i:\bA tibble: 0 [×x]|\bshape: \(0, \d+\)|\bnot waiting for (?:it|them|the \w+) to (?:finish|complete)\b|\bwaiting until\b)",
)
_NO_VERDICT = re.compile("|".join(f"(?:{cue})" for cue in _NO_VERDICT_CUES))
# progress short of done: a percentage under 100 next to a word or a bar of progress
_PERCENT = re.compile(r"(?<![\d.])\d{1,2}(?:\.\d+)?\s?%")
_PROGRESS = re.compile(
    r"(?i:progress|downloading|uploading|executing|backing up|encoding|pulling|syncing|indexing|copying|cloning|remaining|\beta\b"
    r"|\d[KMG]i?B/s\b|[▕█░▓])"
)
_DONE = re.compile(r"\b100\s?%")


# a static analyzer that found nothing has passed: no empty result
_ANALYZER_PASSED = re.compile(r"(?i:\banalyzed\b[^\n]{0,120}?\b0 results?(?:\(s\))? found)")
# a form handed in ("Thank you. Your request has been submitted. Reference: ..."): the action is
# done, as the spent twenty-ninth and thirtieth sets label it; a job submitted to a queue waits
_HANDED_IN = re.compile(r"(?i:\byour (?:\w+ )?(?:request|form|application|claim|enquiry|report) has been submitted\b)")


def tool_no_verdict(text: str) -> str | None:
    """The first sign that a tool's output reports no outcome yet, or None: a job pending, queued,
    running or in progress (`"status": "pending"`, HTTP 202, "Job queued", "Backing up: 41%"), or
    a search or list that ran and found nothing (`"items": []`, "X-Total-Count: 0", "No results
    found", an empty stdout). Such output is neither success nor failure: `decide` scores it 0."""
    match = None if _ANALYZER_PASSED.search(text) or _HANDED_IN.search(text) else _NO_VERDICT.search(text)
    if match is not None:
        return " ".join(match.group(0).split())  # one line, as the vote's text is
    percent = _PERCENT.search(text)
    if percent is not None and _PROGRESS.search(text) and not _DONE.search(text):
        return percent.group(0)
    return None
