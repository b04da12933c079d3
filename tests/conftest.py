"""Settings shared by every test package."""

from hypothesis import HealthCheck, settings

# Property tests assert behaviour, not speed (speed lives in bench/): a per-example deadline only
# turns a loaded machine into a flaky failure, so no example has one.
settings.register_profile("contextsvc", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("contextsvc")
