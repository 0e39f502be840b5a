"""pytest plugin for device runs (`-p benchmarks._instafail`): print each failure as it happens, so a run that its
time limit kills still shows why the tests before it failed."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n[instafail] {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}", flush=True)
