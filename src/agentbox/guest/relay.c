/*
 * In-sandbox gateway relay: 127.0.0.1:PORT -> the mounted gateway unix socket.
 *
 * The same program as relay.py (same options, same behaviour), in C, built
 * static at image-build time (agentbox.image._relay) and installed as
 * /opt/agentbox/relay: a Python interpreter costs ~6 MiB of PSS per sandbox,
 * this ~0.2 MiB (issue 15). It parses nothing: the gateway on the host does
 * all the checking.
 *
 *   relay [--port 8080] [--socket PATH] [--max-conns 64] [-- CMD ARGS...]
 *   relay --listen-fd FD [--socket PATH] [--max-conns 64]
 *
 * relay.py, which the sandbox starts, binds and forks as before, then execs
 * this program in its server process with the listening socket (--listen-fd):
 * no Python stays resident, and an image without this binary keeps the
 * Python relay.
 * Without CMD it serves in the foreground. With CMD it binds and listens
 * first, forks the server into the background (double fork: reparented to
 * init, so CMD never has it as a child), then execs CMD in the original
 * process, which keeps its pid and the signals tini forwards.
 *
 * Each connection gets two pumps (one thread per direction). When one side
 * ends its stream, the other side's write half is shut down (half-close); an
 * error on either side shuts both down. At most --max-conns connections are
 * relayed at once; further ones wait in the listen backlog.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHUNK (64 * 1024)
#define STACK (64 * 1024)

static const char *sock_path = "/run/agentbox/gw/gateway.sock";
static sem_t slots;
static pthread_attr_t attr;

struct pair {
	int src, dst;
};

/* Copy src -> dst until EOF (then half-close dst) or an error (then both down). */
static int pump(int src, int dst)
{
	char *buf = malloc(CHUNK);
	int ok = buf != NULL;
	while (ok) {
		ssize_t n = recv(src, buf, CHUNK, 0);
		if (n == 0)
			break;
		if (n < 0) {
			if (errno == EINTR)
				continue;
			ok = 0;
			break;
		}
		for (ssize_t off = 0; off < n;) {
			ssize_t w = send(dst, buf + off, (size_t)(n - off), MSG_NOSIGNAL);
			if (w < 0) {
				if (errno == EINTR)
					continue;
				ok = 0;
				break;
			}
			off += w;
		}
	}
	free(buf);
	if (ok) {
		shutdown(dst, SHUT_WR);
	} else {
		shutdown(src, SHUT_RDWR);
		shutdown(dst, SHUT_RDWR);
	}
	return ok;
}

static void *back(void *arg)
{
	struct pair *p = arg;
	pump(p->src, p->dst);
	return NULL;
}

static void *serve_one(void *arg)
{
	int client = (int)(long)arg;
	int up = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	strncpy(sa.sun_path, sock_path, sizeof(sa.sun_path) - 1);
	if (up >= 0 && connect(up, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
		struct pair p = {up, client};
		pthread_t t;
		if (pthread_create(&t, &attr, back, &p) == 0) {
			pump(client, up);
			pthread_join(t, NULL);
		}
	}
	/* No gateway (or no thread): the client sees the connection close. */
	if (up >= 0)
		close(up);
	close(client);
	sem_post(&slots);
	return NULL;
}

static void serve(int listener)
{
	for (;;) {
		while (sem_wait(&slots) != 0)
			;
		int client = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
		if (client < 0) {
			sem_post(&slots);
			continue;
		}
		int one = 1;
		setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		pthread_t t;
		if (pthread_create(&t, &attr, serve_one, (void *)(long)client) != 0) {
			close(client);
			sem_post(&slots);
			continue;
		}
		pthread_detach(t);
	}
}

static int listen_on(int port)
{
	int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	int one = 1;
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (s < 0 || setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
	    bind(s, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(s, 128) != 0)
		return -1;
	return s;
}

static void detach_stdio(void)
{
	/* The server must not write into (or hold open) the workload's stdout/stderr. */
	int fd = open("/dev/null", O_RDWR);
	for (int i = 0; i < 3; i++)
		dup2(fd, i);
	if (fd > 2)
		close(fd);
}

static int usage(const char *why)
{
	fprintf(stderr, "usage: relay [--port N] [--socket PATH] [--max-conns N] [-- CMD ARGS...]\n"
			"relay: error: %s\n", why);
	return 2;
}

static int number(const char *s, long lo, long hi, long *out)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < lo || v > hi)
		return -1;
	*out = v;
	return 0;
}

int main(int argc, char **argv)
{
	long port = 8080, max_conns = 64, listen_fd = -1;
	char **cmd = NULL;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--") == 0) {
			cmd = argv + i + 1;
			break;
		}
		if (i + 1 >= argc)
			return usage("an option without its value");
		if (strcmp(a, "--port") == 0) {
			if (number(argv[++i], 0, 65535, &port))
				return usage("--port must be within 0..65535");
		} else if (strcmp(a, "--socket") == 0) {
			sock_path = argv[++i];
			if (strlen(sock_path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
				return usage("--socket is too long");
		} else if (strcmp(a, "--listen-fd") == 0) {
			if (number(argv[++i], 0, 1 << 20, &listen_fd))
				return usage("--listen-fd must be a descriptor number");
		} else if (strcmp(a, "--max-conns") == 0) {
			if (number(argv[++i], 1, 1024, &max_conns))
				return usage("--max-conns must be within 1..1024");
		} else {
			return usage("unknown option");
		}
	}
	if (cmd != NULL && cmd[0] == NULL)
		cmd = NULL;
	if (listen_fd >= 0 && cmd != NULL)
		return usage("--listen-fd serves in the foreground: no CMD");
	int listener = listen_fd >= 0 ? (int)listen_fd : listen_on((int)port);
	if (listen_fd >= 0) {
		int type = 0;
		socklen_t len = sizeof(type);
		if (getsockopt(listener, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) {
			fprintf(stderr, "relay: --listen-fd %ld is not a stream socket\n", listen_fd);
			return 1;
		}
		fcntl(listener, F_SETFD, FD_CLOEXEC);
	}
	if (listener < 0) {
		fprintf(stderr, "relay: cannot listen on 127.0.0.1:%ld: %s\n", port, strerror(errno));
		return 1;
	}
	mallopt(M_ARENA_MAX, 1); /* one heap for all threads: a few buffers, not an arena each */
	sem_init(&slots, 0, (unsigned)max_conns);
	pthread_attr_init(&attr);
	pthread_attr_setstacksize(&attr, STACK);
	signal(SIGPIPE, SIG_IGN);
	if (cmd == NULL) {
		serve(listener);
		return 0;
	}
	pid_t pid = fork();
	if (pid < 0) {
		fprintf(stderr, "relay: cannot fork: %s\n", strerror(errno));
		return 1;
	}
	if (pid == 0) {
		if (fork() == 0) { /* the server */
			setsid();
			detach_stdio();
			serve(listener);
		}
		_exit(0);
	}
	waitpid(pid, NULL, 0);
	close(listener);
	/* CMD gets the default SIGPIPE disposition back (exec keeps SIG_IGN). */
	signal(SIGPIPE, SIG_DFL);
	execvp(cmd[0], cmd);
	fprintf(stderr, "relay: cannot run %s: %s\n", cmd[0], strerror(errno));
	return 127;
}
