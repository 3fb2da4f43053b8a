"""Judging: comparing a target's outputs with the reference (``compare``), the result vocabulary and
the documents that carry it (``verdict``), and repeated runs of a nondeterministic case (``flaky``)."""
