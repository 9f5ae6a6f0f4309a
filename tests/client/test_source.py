"""The client creates an experiment with a metric source, reads it back, and gets the 422 of a bad one."""

from __future__ import annotations

import pytest

from pasto_client import PastoAPIError

SOURCE = {
    "files": {"exposures": {"path": "/data/exposures/*.parquet"}, "events": {"path": "/data/events/*.parquet"}},
    "mapping": {"exposures": {"table": "exposures", "unit": "unit", "arm": "arm", "round": "round"},
                "events": {"table": "events", "unit": "unit", "timestamp": "ts",
                           "metrics": {"watch_time": "watch_time", "like_rate": "like_rate"}}},
}


def test_an_experiment_with_a_source_round_trips(admin, create_experiment):
    name = create_experiment(source=SOURCE)
    assert admin.get_experiment(name)["source"] == SOURCE
    assert [entry["index"] for entry in admin.rounds(name)] == [0]


def test_a_source_with_a_password_is_refused(admin, create_experiment):
    with pytest.raises(PastoAPIError) as refused:
        create_experiment(source={**SOURCE, "url": "postgresql+psycopg://reader:secret@db/warehouse"})
    assert refused.value.status == 422
    assert refused.value.details[0]["location"] == "source"
    assert "contains a password" in refused.value.details[0]["message"]
