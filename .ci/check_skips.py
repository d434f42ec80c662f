"""Fail CI when any test was skipped other than the CUDA tests (no GPU on CI machines), or when
fewer tests ran than the suite holds.

Reads the JUnit XML that .ci/run asks pytest for. A skip elsewhere means a dependency or a
server the suite needs was missing, and a green run would not mean what it says. ``--expect N``:
the number of tests a plain collection finds (``.ci/run`` counts them with no options from the
environment); a run that reports fewer (deselected by ``-m``, ``-k`` or ``--deselect`` in
``PYTEST_ADDOPTS``) fails.
"""

import sys
import xml.etree.ElementTree as ET

ALLOWED = ("tests.test_cuda", "tests.test_cuda_snapshot", "tests.test_cuda_paths")  # modules whose tests need a CUDA device


def main(path: str, expect: int = 0) -> int:
    skipped = []
    cases = list(ET.parse(path).getroot().iter("testcase"))
    if len(cases) < expect:
        print(f"only {len(cases)} test(s) ran, but the suite holds {expect}: tests were deselected "
              "(PYTEST_ADDOPTS?); CI runs all of them", file=sys.stderr)
        return 1
    for case in cases:
        skip = case.find("skipped")
        if skip is not None and not case.get("classname", "").startswith(ALLOWED):
            skipped.append(f"{case.get('classname')}::{case.get('name')}: {skip.get('message', '')}")
    if skipped:
        print(f"{len(skipped)} test(s) skipped outside the CUDA tests:\n" + "\n".join(skipped), file=sys.stderr)
        return 1
    print("no skips outside the CUDA tests")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    expect = 0
    if "--expect" in args:
        i = args.index("--expect")
        expect = int(args[i + 1])
        del args[i : i + 2]
    sys.exit(main(args[0], expect))
