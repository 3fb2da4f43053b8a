"""The result vocabulary: verdicts, culprits and migration states, typed and validated.

Every check tapml makes (a carved case alone, a region, the whole model) ends in a
:class:`Verdict` whose ``status`` is one of :data:`STATUSES`. :func:`outcome_verdict` is the
one mapping from what a run produced (an exception or a comparison) to a verdict;
:class:`DeviceLost` is never turned into one: it is re-raised, because it says nothing about
the code under test. Culprits have a ``kind`` from :data:`CULPRIT_KINDS`, in the order reports
list them. :class:`VerdictDocument` (``replay --json``) and :class:`MigrationState`
(``migrate --state``, ``session save``) are the files; each document and each of its parts is
declared once as a schema (:class:`VerdictJSON`, :class:`MigrationStateJSON`, ... : types,
required keys, closed sets, finite numbers), their ``from_json`` validates a whole document
against it and raises :class:`~tapml.errors.TapmlError` naming the file, the field's path and
what is expected, since these files may come from anyone (SECURITY.md).

The package holds three parts, by what they do: :mod:`tapml.judging.verdict.results` (the verdicts,
culprits and the closed sets of their fields), :mod:`tapml.judging.verdict.documents` (the files:
Verdict JSON, migration states, Generation, Precision, Preflight and Bench JSON, journal records)
and :mod:`tapml.judging.verdict.reading` (how a schema is applied to a file, and the strict read). Import from
``tapml.judging.verdict``: it re-exports every public name of the three.

Example::

    state = MigrationState.read("gpt2.json")      # TapmlError (exit 2) when malformed
    state.passed, summary(state.cases)             # False, {"pass": 73, "mismatch": 1, ...}
    state.culprits[0].kind                         # 'op'
"""

from tapml.judging.verdict.documents import (END_TO_END_STATUSES, FORMAT_VERSION, PLACES, PRECISION_DTYPES,
                                     PRECISION_FORMAT_VERSION, STAGES, STATE_FORMAT, STEP_STATUSES, STEP_SUMMARY_KEYS,
                                     BenchJSON, DeviceJSON, GenerationJSON, PoolDeviceJSON, MigrationState, MigrationStateJSON, PrecisionJSON,
                                     PreflightJSON, VerdictDocument, VerdictDocumentJSON, is_generation_document, is_precision_document,
                                     journal_record, keep_float32_header, read_bench_document, read_generation_document, read_preflight_document,
                                     read_precision_document)
from tapml.judging.verdict.kinds import FALLBACK_RULES, KINDS, document_kind, stamp
from tapml.judging.verdict.reading import MAX_COUNT, MAX_DEPTH, check_depth
from tapml.judging.verdict.results import (BLAME, CULPRIT_KINDS, GRAPH_KINDS, JUDGE_KEYS, NEAR_FAILING, RULES, STAT_KEYS,
                                   STATUSES, TIMINGS, UNIT_KINDS, CaseVerdict, CaseVerdictJSON, Culprit, CulpritJSON,
                                   EndToEnd, EndToEndJSON, RegionCheck, RegionCheckJSON, UnitVerdict, UnitVerdictJSON,
                                   Verdict, VerdictJSON, culprit_kind, outcome_verdict, passed, summary)

__all__ = ["KINDS", "FALLBACK_RULES", "document_kind", "stamp", "Verdict", "CaseVerdict", "UnitVerdict", "RegionCheck", "EndToEnd", "Culprit", "VerdictDocument",
           "MigrationState", "read_generation_document", "read_preflight_document", "read_bench_document", "is_generation_document", "STEP_STATUSES",
           "read_precision_document", "is_precision_document", "PRECISION_FORMAT_VERSION", "PRECISION_DTYPES",
           "END_TO_END_STATUSES", "outcome_verdict", "culprit_kind", "summary", "passed", "journal_record", "check_depth",
           "STATUSES", "STAT_KEYS", "TIMINGS", "CULPRIT_KINDS", "UNIT_KINDS", "GRAPH_KINDS", "STAGES", "STATE_FORMAT",
           "FORMAT_VERSION", "keep_float32_header", "JUDGE_KEYS", "NEAR_FAILING", "RULES", "BLAME", "PLACES",
           "STEP_SUMMARY_KEYS", "MAX_DEPTH", "MAX_COUNT", "VerdictJSON", "CaseVerdictJSON", "UnitVerdictJSON",
           "RegionCheckJSON", "EndToEndJSON", "CulpritJSON", "VerdictDocumentJSON", "MigrationStateJSON", "DeviceJSON",
           "GenerationJSON", "PrecisionJSON", "PreflightJSON", "BenchJSON", "PoolDeviceJSON"]
