import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.net.HttpURLConnection;
import java.net.InetAddress;
import java.net.Proxy;
import java.net.URL;
import java.nio.charset.StandardCharsets;
import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.HashSet;
import java.util.List;
import java.util.Set;

/**
 * A JVM client as an application writes one: resolves the URL's host with the JVM's own resolver
 * (InetAddress: glibc, the pod's resolv.conf) and fetches the URL with HttpURLConnection, with the
 * JVM's default socket family (no -Djava.net.preferIPv4Stack). One line per fact, for the test to read:
 *
 * <pre>
 * resolved 203.0.113.10          every address InetAddress returned, in its order
 * socket AF_INET6 [::ffff:169.254.7.1]:15001   each open TCP socket of this process, as the kernel
 *                                lists it (/proc/self/net/tcp6 or tcp) while the response is read
 * status 200
 * body api-endpoint              the response body, trimmed
 * </pre>
 *
 * Exits 1 with the exception on stderr if anything fails.
 */
public final class Fetch {
    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: java Fetch http://HOST[:PORT]/PATH");
            System.exit(2);
        }
        URL url = new URL(args[0]);
        for (InetAddress a : InetAddress.getAllByName(url.getHost())) {
            System.out.println("resolved " + a.getHostAddress());
        }
        HttpURLConnection conn = (HttpURLConnection) url.openConnection(Proxy.NO_PROXY);
        conn.setConnectTimeout(10_000);
        conn.setReadTimeout(10_000);
        int status = conn.getResponseCode();
        // The connection is open until its body is read: its socket is in the kernel's tables now.
        for (String socket : openTcpSockets()) {
            System.out.println("socket " + socket);
        }
        System.out.println("status " + status);
        try (InputStream in = conn.getInputStream()) {
            System.out.println("body " + new String(readAll(in), StandardCharsets.UTF_8).trim());
        }
        conn.disconnect();
    }

    private static byte[] readAll(InputStream in) throws IOException {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        byte[] buf = new byte[4096];
        for (int n; (n = in.read(buf)) > 0; ) {
            out.write(buf, 0, n);
        }
        return out.toByteArray();
    }

    /** "FAMILY PEER:PORT" (the kernel's peer, IPv6 in brackets) for every TCP socket this process has open, from the kernel's tables. */
    private static List<String> openTcpSockets() throws IOException {
        Set<String> inodes = new HashSet<>();
        try (DirectoryStream<Path> fds = Files.newDirectoryStream(Paths.get("/proc/self/fd"))) {
            for (Path fd : fds) {
                try {
                    String target = Files.readSymbolicLink(fd).toString();
                    if (target.startsWith("socket:[")) {
                        inodes.add(target.substring(8, target.length() - 1));
                    }
                } catch (IOException gone) {
                    // The fd the directory listing itself used is closed by now.
                }
            }
        }
        List<String> found = new java.util.ArrayList<>();
        collect("/proc/self/net/tcp", "AF_INET", inodes, found);
        collect("/proc/self/net/tcp6", "AF_INET6", inodes, found);
        return found;
    }

    // A table line: "sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...",
    // addresses as hex 32-bit words in host (little-endian) order, then ":" and the hex port.
    private static void collect(String table, String family, Set<String> inodes, List<String> found)
            throws IOException {
        List<String> lines = Files.readAllLines(Paths.get(table));
        for (String line : lines.subList(1, lines.size())) {
            String[] f = line.trim().split("\\s+");
            if (f.length > 9 && inodes.contains(f[9])) {
                found.add(family + " " + peer(f[2]));
            }
        }
    }

    private static String peer(String hex) {
        String[] parts = hex.split(":");
        byte[] b = new byte[parts[0].length() / 2];
        for (int word = 0; word < b.length / 4; word++) {
            for (int i = 0; i < 4; i++) {
                int at = word * 8 + (3 - i) * 2;
                b[word * 4 + i] = (byte) Integer.parseInt(parts[0].substring(at, at + 2), 16);
            }
        }
        int port = Integer.parseInt(parts[1], 16);
        return b.length == 4 ? dotted(b, 0) + ":" + port : "[" + ipv6Text(b) + "]:" + port;
    }

    /** A v4-mapped address stays in ::ffff:a.b.c.d form (InetAddress would unmap it). */
    private static String ipv6Text(byte[] b) {
        boolean mapped = b[10] == (byte) 0xff && b[11] == (byte) 0xff;
        for (int i = 0; i < 10; i++) {
            mapped &= b[i] == 0;
        }
        if (mapped) {
            return "::ffff:" + dotted(b, 12);
        }
        StringBuilder s = new StringBuilder();
        for (int i = 0; i < 16; i += 2) {
            if (i > 0) {
                s.append(':');
            }
            s.append(Integer.toHexString(((b[i] & 0xff) << 8) | (b[i + 1] & 0xff)));
        }
        return s.toString();
    }

    private static String dotted(byte[] b, int from) {
        return (b[from] & 0xff) + "." + (b[from + 1] & 0xff) + "." + (b[from + 2] & 0xff) + "."
                + (b[from + 3] & 0xff);
    }
}
