"""The real S3 server the weight-cache tests run against (SeaweedFS, ``weed server -s3``): the S3
behaviour kvfleet's pull relies on, checked on the server itself, and its starter's cleanup."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from kvfleet_testkit.seaweedfs import SeaweedS3, seaweedfs_s3_server

MiB = 1 << 20


def _client(server: SeaweedS3, secret: str | None = None) -> boto3.client:
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=secret or server.secret_key,
        region_name=server.region,
        config=Config(retries={"max_attempts": 1}),
    )


def test_ranged_get_etag_precondition_and_multipart(seaweedfs: SeaweedS3) -> None:
    s3 = _client(seaweedfs)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    body = os.urandom(6 * MiB + 123)
    # Multipart upload (populate's path), two parts of at least 5 MiB as S3 requires.
    upload = s3.create_multipart_upload(Bucket=bucket, Key="m/shard")
    parts = []
    for number, start in ((1, 0), (2, 5 * MiB)):
        chunk = body[start : start + 5 * MiB] if number == 1 else body[start:]
        etag = s3.upload_part(Bucket=bucket, Key="m/shard", UploadId=upload["UploadId"], PartNumber=number, Body=chunk)[
            "ETag"
        ]
        parts.append({"ETag": etag, "PartNumber": number})
    s3.complete_multipart_upload(
        Bucket=bucket, Key="m/shard", UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )
    head = s3.head_object(Bucket=bucket, Key="m/shard")
    assert head["ContentLength"] == len(body)
    # A ranged GET with the object's ETag returns exactly that range.
    got = s3.get_object(Bucket=bucket, Key="m/shard", Range="bytes=1000-5242999", IfMatch=head["ETag"])
    assert got["Body"].read() == body[1000:5243000]
    # Another ETag is refused with 412: the pull's check that the object did not change under it.
    with pytest.raises(ClientError) as refused:
        s3.get_object(Bucket=bucket, Key="m/shard", Range="bytes=0-9", IfMatch='"0123456789abcdef"')
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="m/")
    assert [o["Key"] for o in listed["Contents"]] == ["m/shard"]


def test_wrong_secret_is_refused(seaweedfs: SeaweedS3) -> None:
    with pytest.raises(ClientError) as refused:
        _client(seaweedfs, secret="not-the-secret").list_buckets()
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_starter_stops_the_process_and_removes_its_directory(seaweedfs: SeaweedS3) -> None:
    # A second, short-lived server beside the session's: its own ports, its own data directory.
    with seaweedfs_s3_server() as server:
        assert server.endpoint_url != seaweedfs.endpoint_url
        _client(server).create_bucket(Bucket="probe")
        pid, root = server.pid, server.data_dir
        assert Path(f"/proc/{pid}").exists()
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert not root.exists()
