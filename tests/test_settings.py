"""Each setting declared once: the chart sets only flags the services' own command
lines take (and every one the coordinator's table says it sets), and every
coordinator flag `specdec up` takes reaches the coordinator as given."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

import coordinator.__main__
from coordinator.settings import SETTINGS
from specdec.service.settings import (SERVICES, model_service_parser, service_settings,
                                     up_passthrough as model_passthrough)
from specdec_tools.cli import coordinator_passthrough, parser as cli_parser
from tests.test_helm import VARIATIONS, by_kind, containers, render

PARSERS = {"coordinator": coordinator.__main__.build_parser, "drafter": lambda: model_service_parser("drafter"),
           "verifier": lambda: model_service_parser("verifier")}


class Refused(Exception):
    pass


def strict(build) -> argparse.ArgumentParser:
    parser = build()

    def error(message):  # argparse exits; a test wants the message
        raise Refused(message)
    parser.error = error
    return parser


@pytest.mark.parametrize("name", list(VARIATIONS))
def test_every_container_the_chart_renders_passes_args_its_service_takes(name):
    seen = set()
    for deployment in by_kind(render(VARIATIONS[name]), "Deployment"):
        for container_name, container in containers(deployment).items():
            if container_name not in PARSERS:
                continue
            seen.add(container_name)
            try:
                strict(PARSERS[container_name]).parse_args(container["args"])
            except Refused as refused:
                pytest.fail(f"{name}: the chart's {container_name} args are refused: {refused}")
    assert seen == set(PARSERS)


@pytest.mark.parametrize("name", list(VARIATIONS))
def test_the_chart_sets_every_setting_it_is_declared_to(name):
    rendered = {}
    for deployment in by_kind(render(VARIATIONS[name]), "Deployment"):
        rendered.update(containers(deployment))
    declared = {"coordinator": SETTINGS, "drafter": service_settings("drafter"),
                "verifier": service_settings("verifier")}
    for container, settings in declared.items():
        flags = {a.split("=", 1)[0] for a in rendered[container]["args"]}
        missing = [s.flag for s in settings if s.chart and s.flag not in flags]
        assert missing == [], container


SAMPLES = {int: "7", float: "2.5", None: "value"}


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.up], ids=lambda s: s.flag)
def test_specdec_up_hands_each_of_its_coordinator_settings_on_as_given(setting):
    choices = setting.options.get("choices")
    given = choices[-1] if choices else SAMPLES[setting.options.get("type")]
    args = cli_parser().parse_args(["up", "--pair", "tiny", setting.flag, given])
    passed = coordinator_passthrough(args)
    assert passed[0] == setting.flag
    coordinator_args = strict(coordinator.__main__.build_parser).parse_args(["--verifier", "x", *passed])
    expected = (setting.options.get("type") or str)(given)
    assert getattr(coordinator_args, setting.dest) == expected


@pytest.mark.parametrize("service,setting", [(service, s) for service in SERVICES for s in service_settings(service)
                                             if s.up], ids=lambda x: x if isinstance(x, str) else x.flag)
def test_specdec_up_hands_each_model_service_setting_to_that_service_as_given(setting, service):
    switch = setting.options.get("action") == "store_true"   # a switch stays one: no value
    choices = setting.options.get("choices")
    given = () if switch else (choices[-1] if choices else SAMPLES[setting.options.get("type")],)
    args = cli_parser().parse_args(["up", "--pair", "tiny", f"--{service}-{setting.flag[2:]}", *given])
    passed = model_passthrough(args, service)
    assert passed == (setting.flag, *given)
    other = next(s for s in SERVICES if s != service)
    assert model_passthrough(args, other) == ()   # the other service is not touched
    service_args = strict(lambda: model_service_parser(service)).parse_args(["--model", "tiny", *passed])
    assert getattr(service_args, setting.dest) == (True if switch else (setting.options.get("type") or str)(given[0]))


def test_up_passes_nothing_it_was_not_given():
    args = cli_parser().parse_args(["up", "--pair", "tiny"])
    assert coordinator_passthrough(args) == () and all(model_passthrough(args, s) == () for s in SERVICES)


def test_every_service_takes_the_shared_flags_once():
    from specdec.rpc.flags import SHARED
    for build in PARSERS.values():
        options = [o for a in build()._actions for o in a.option_strings]
        assert all(options.count(flag) == 1 for flag in SHARED)


def test_specdec_up_offers_the_quantizations_the_model_services_have():
    from specdec.runtime.quant import QUANTIZE
    up = next(a for a in cli_parser()._subparsers._group_actions[0].choices["up"]._actions
              if a.dest == "draft_quantize")
    assert set(up.choices) == set(QUANTIZE)


def test_the_charts_schema_offers_the_quantizations_the_model_services_have():
    import json
    import pathlib
    from specdec.runtime.quant import QUANTIZE
    schema = json.loads((pathlib.Path(__file__).resolve().parent.parent / "deploy/helm/specdec/values.schema.json")
                        .read_text())
    for component in ("verifier", "drafter"):
        assert set(schema["properties"][component]["properties"]["quantize"]["enum"]) == set(QUANTIZE), component


def other_value(setting) -> list[str]:
    """The flag with a value other than its default, as typed on a command line."""
    options = setting.options
    if options.get("action") == "store_true":
        return [setting.flag]
    if "choices" in options:
        return [setting.flag, next(c for c in options["choices"] if c != options.get("default"))]
    kind = options.get("type")
    value = {int: "7", float: "2.5", None: "elsewhere:1"}.get(kind, {"--gamma": "3", "--cost-curve": "10,11:0.5"}
                                                           .get(setting.flag))
    return [setting.flag, value]


@pytest.mark.parametrize("service", ["coordinator", *SERVICES])
def test_a_setting_named_as_its_configs_field_reaches_the_config_with_no_line_to_hand_it_over(service):
    """`flags.config_from`: a new setting is its `Setting` and its config field; each
    one given a value off its default on the command line arrives in the config."""
    from coordinator.__main__ import coordinator_config
    from coordinator.service import CoordinatorConfig
    from specdec.service.cli_common import serve_config
    from specdec.service.model_service import ServeConfig
    config_class, build = ((CoordinatorConfig, coordinator_config) if service == "coordinator"
                           else (ServeConfig, serve_config))
    table = SETTINGS if service == "coordinator" else service_settings(service)
    fields = {f.name for f in dataclasses.fields(config_class)}
    named = [s for s in table if s.dest in fields]
    assert len(named) >= 8   # most of the table goes over by name
    required = ["--verifier", "v:1"] if service == "coordinator" else ["--model", "m"]
    default = build(strict(PARSERS[service]).parse_args(required))
    for setting in named:
        argv = other_value(setting) + (required if setting.flag != required[0] else [])
        args = strict(PARSERS[service]).parse_args(argv)
        given, arrived = getattr(args, setting.dest), getattr(build(args), setting.dest)
        assert arrived != getattr(default, setting.dest), setting.flag
        if type(given) is type(arrived):   # else converted on the way ("on" -> True)
            assert arrived == given, setting.flag
