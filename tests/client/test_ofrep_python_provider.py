"""The third-party Python OFREP provider (``openfeature-provider-ofrep``), unchanged, against a running
pasto server (``pasto serve``): it evaluates experiments exactly as /assign assigns, with the served
propensities in the flag metadata, and bad contexts get the protocol's error codes."""

from __future__ import annotations

import pytest
from openfeature import api as openfeature
from openfeature.contrib.provider.ofrep import OFREPProvider
from openfeature.evaluation_context import EvaluationContext
from openfeature.exception import ErrorCode
from openfeature.flag_evaluation import Reason

N_UNITS = 10_000


@pytest.fixture
def ofrep_client(server):
    """``ofrep_client(token)``: an OpenFeature client served by the OFREP provider with ``token``."""
    domains = []

    def make(token: str):
        domain = f"ofrep-{len(domains)}"
        provider = OFREPProvider(server.url, headers_factory=lambda: {"Authorization": f"Bearer {token}"}, timeout=30)
        # The server is on loopback: no proxy, netrc or CA bundle from the environment applies, and
        # requests would read the whole environment for them at every evaluation (a fifth of the
        # test's CPU over 10,000 of them). The provider's code is unchanged; only its session's setting.
        provider.session.trust_env = False
        openfeature.set_provider_and_wait(provider, domain)
        domains.append(domain)
        return openfeature.get_client(domain)

    yield make
    openfeature.shutdown()


def test_ten_thousand_units_get_the_arms_assign_gives(server, admin, create_experiment, true_means, ofrep_client):
    name = create_experiment()
    units = [f"user-{i}" for i in range(N_UNITS - 3)] + ["déjà vu", "ユーザー", "😀"]
    # Move the mixture away from uniform so that the propensities differ between arms.
    first = admin.assign_many(name, units[:2000])
    admin.observe(name, [{"id": f"o-{i}", "unit": units[i], "round": 0,
                          "values": dict(zip(("watch_time", "like_rate"), true_means[a.arm]))}
                         for i, a in enumerate(first)])
    admin.close_round(name)
    expected = admin.assign_many(name, units)
    served = admin.get_experiment(name)
    assert len(set(served["probabilities"])) > 1
    client = ofrep_client(server.admin_token)
    arms = [arm["name"] for arm in served["arms"]]
    for unit, want in zip(units, expected):
        details = client.get_object_details(name, {}, EvaluationContext(unit, {"country": "fr"}))
        assert details.error_code is None, details
        assert (details.variant, details.value, details.reason) == (want.arm, dict(want.params), Reason.SPLIT)
        assert details.flag_metadata["propensity"] == served["probabilities"][arms.index(want.arm)] == want.probability
        assert details.flag_metadata["round"] == want.round == 1
        assert details.flag_metadata["mixture_version"] == served["updated_at"]


def test_bad_contexts_get_the_protocol_error_codes(server, admin, create_experiment, ofrep_client):
    name = create_experiment()
    segmented = create_experiment(segments=["web", "app"], objective={
        "primary": "watch_time", "guardrails": [{"metric": "like_rate", "threshold": 0.5, "hard": True}]})
    client = ofrep_client(server.admin_token)
    default = {"fallback": True}

    def error(flag: str, context: EvaluationContext):
        details = client.get_object_details(flag, default, context)
        assert details.value == default
        return details.error_code

    assert error(name, EvaluationContext(None, {"country": "fr"})) == ErrorCode.TARGETING_KEY_MISSING
    assert error("no-such-experiment", EvaluationContext("u")) == ErrorCode.FLAG_NOT_FOUND
    assert error(name, EvaluationContext("u" * 300)) == ErrorCode.INVALID_CONTEXT
    assert error(segmented, EvaluationContext("u")) == ErrorCode.INVALID_CONTEXT
    assert error(segmented, EvaluationContext("u", {"segment": "tv"})) == ErrorCode.INVALID_CONTEXT
    web = client.get_object_details(segmented, default, EvaluationContext("u", {"segment": "web"}))
    assert web.error_code is None and web.flag_metadata["segment"] == "web"
    assert web.variant == admin.assign(segmented, "u", segment="web").arm
    # Tokens: a missing or unknown one is 401, a read token 403; the provider reports GENERAL for both.
    assert ofrep_client("not-a-token").get_object_details(name, default, EvaluationContext("u")).error_code \
        == ErrorCode.GENERAL
    read = server.pasto("tokens", "create", "--role", "read").strip()
    assert ofrep_client(read).get_object_details(name, default, EvaluationContext("u")).error_code == ErrorCode.GENERAL
