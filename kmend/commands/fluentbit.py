"""`kmend fluentbit-config`: print a Fluent Bit YAML config that feeds the service."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.rules import context_patterns, default_rules_dir, load_rules
from collector.fluentbit import FluentBitOptions, dump_config, dump_configmap, render_config


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the subcommand."""
    defaults = FluentBitOptions()
    p = sub.add_parser("fluentbit-config", help="render a Fluent Bit config (YAML) for the service")
    p.add_argument("--service-host", default=defaults.service_host, help="kmend service host")
    p.add_argument("--service-port", type=int, default=defaults.service_port, help="kmend service port")
    p.add_argument("--tls", action="store_true", help="HTTPS to the service")
    p.add_argument("--token-env", default=defaults.token_env,
                   help="environment variable with the bearer token ('' for none)")
    p.add_argument("--rules", type=Path, action="append", help="rule pack file or directory (repeatable)")
    p.add_argument("--no-grep", action="store_true", help="ship every line (no rule-based grep filter)")
    p.add_argument("--no-kmsg", action="store_true", help="do not read the kernel log")
    p.add_argument("--configmap", action="store_true", help="wrap it in a Kubernetes ConfigMap")
    p.add_argument("--namespace", default="kmend-system", help="namespace of the ConfigMap")
    p.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Render from the rule packs; a bad rule fails here, before Fluent Bit sees it.

    Container logs also keep the lines the progress packs match: the service's hang
    and straggler detectors read them.
    """
    rules = load_rules(args.rules or [default_rules_dir()])
    progress = load_progress_rules([default_progress_rules_dir()])
    container = [] if args.no_grep else ([r.pattern for r in rules if r.applies_to("container")]
                                         + context_patterns(rules, "container") + [r.regex.pattern for r in progress])
    kernel = [] if args.no_grep else ([r.pattern for r in rules if r.applies_to("kernel")]
                                      + context_patterns(rules, "kernel"))
    opts = FluentBitOptions(service_host=args.service_host, service_port=args.service_port, tls=args.tls,
                            token_env=args.token_env or None, kmsg=not args.no_kmsg)
    text = dump_config(render_config(opts, container_patterns=container, kernel_patterns=kernel))
    if args.configmap:
        text = dump_configmap(text, namespace=args.namespace)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0
