# The Python base from Debian's packages (images/base/build.sh bootstraps rootfs.tar): a stand-in for the pinned
# python:*-slim image where no registry is reachable.
FROM scratch
ADD rootfs.tar /
ENV LANG=C.UTF-8 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["python3"]
